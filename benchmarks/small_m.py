"""Small-M projections (decode at 1..64 tokens): bf16 cuBLAS, FP8 `_scaled_mm` and the FP8
weight-only kernel, against the weight-read floor measured in the same run (on a GPU).

    python -m benchmarks.small_m [--sweep] [--result-file bench-results/small-m.json]

For the llama-8b-shape projections (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down
14336->4096, lm_head 4096->128256) at M = 1, 2, 4, 8, 16, 32, 64:

* `bf16`: `F.linear` (cuBLAS) on bf16 weights;
* `mm`: `torch._scaled_mm` with row-wise scales on activations already quantized (what qkv,
  gate_up and down get from the fused quantizing norm / SiLU kernels), and `mm+q`: with the
  single-pass per-token quantization before it (what o_proj pays);
* `w8a16`: the weight-only kernel (`kernels.triton_fp8_gemv.weight_only_linear`, its shipped
  tables: the GEMV kernel up to `GEMV_MAX_M` rows, the tiled one above);
* `gemv16` (M <= `GEMV_MAX_M`): the GEMV kernel on the bf16 weights (`linear_16bit`), against
  `bf16`'s cuBLAS: what `executor.quantization.BF16_GEMV_MAX_M` would switch on.

Each time is one call's share of a CUDA graph that calls the projection on enough distinct
copies of its weights (>= 512 MB per replay, ten times the H200's L2) that every call reads its
weights from HBM, as a decode step does (32 layers of different weights); the median of the
replays. GB/s counts the weight bytes (bf16: 2 per element, FP8: 1 plus the scales) over that
time, `frac` is that rate over the device-to-device copy bandwidth measured at the start of the
run (2 x bytes / time, read + write, as WORKLOADS.md quotes it). `winner` is the faster FP8 path,
`mm` for the shapes whose input comes quantized from a fused kernel, `mm+q` for o_proj;
`executor.quantization.WEIGHT_ONLY_MAX_M` is to be set to the largest M where `w8a16` wins on
every shape, and `BF16_GEMV_MAX_M` to the largest where `gemv16` beats cuBLAS on every shape.

`--sweep` also times other launch configurations per shape and M and prints the best: at M = 1, 2
and 4 (`SWEEP_GEMV_M`) the GEMV kernel's (`gemv_sweep_configs`: BLOCK_N, BLOCK_K, SPLIT_K, warps,
stages, accumulator) for both weight dtypes, beside cuBLAS bf16 and the tiled kernel's table entry
for FP8, each as a fraction of the copy bandwidth; then the winners as `GEMV_TABLE` lines to
paste into `kernels/triton_fp8_gemv.py`. Above `GEMV_MAX_M` it times the tiled kernel's
(`sweep_configs`), to set `triton_fp8_gemv.CONFIG_TABLE`. `--shapes` and `--m` narrow a run.

`--device cpu --quick` runs the same code on tiny shapes (the Triton kernel interpreted, the FP8
reference standing in for `_scaled_mm`): a smoke test of this script; its times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.common.tables import markdown_table

M_VALUES = (1, 2, 4, 8, 16, 32, 64)
SWEEP_GEMV_M = (1, 2, 4)
# Inputs of qkv, gate_up and down arrive quantized from a fused kernel; o_proj's is quantized by
# a separate pass (executor.model).
FUSED_QUANT_INPUT = {"qkv": True, "o": False, "gate_up": True, "down": True, "lm_head": True}
_L2_SPAN_BYTES = 512 << 20  # distinct weight bytes each graph replay reads
_MAX_COPIES = 64
_REPLAYS = 20


def projection_shapes(scale: int = 1) -> dict[str, tuple[int, int]]:
    """(N, K) of the llama-8b-shape projections; `scale` > 1 divides both and adds an odd
    remainder (the CPU smoke run: no tile divides them)."""
    from benchmarks.breakdown import projection_shapes as shapes

    if scale == 1:
        return shapes()
    return {name: (n // scale + 1, k // scale + 3) for name, (n, k) in shapes().items()}


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy of `nbytes`, counting read + write (median of 10): on
    CUDA the executor's own measurement (`executor.profiling.measure_copy_bandwidth`)."""
    if device.type == "cuda":
        from pagedserve.executor.profiling import measure_copy_bandwidth

        return measure_copy_bandwidth(device, nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [_seconds(lambda: dst.copy_(src), device) for _ in range(10)]
    return 2 * nbytes / statistics.median(times)


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_per_call(calls: list[Callable[[], object]], device: torch.device) -> float:
    """Seconds per call: on CUDA the calls captured in one graph (after an eager warm-up, which
    compiles), the median over replays divided by their number; elsewhere one eager pass."""
    if device.type != "cuda":
        return _seconds(lambda: [c() for c in calls], device) / len(calls)
    for call in calls:
        call()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = [_seconds(graph.replay, device) for _ in range(_REPLAYS)]
    del graph
    return statistics.median(times) / len(calls)


def _copies(nbytes: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    return max(2, min(_MAX_COPIES, math.ceil(_L2_SPAN_BYTES / nbytes)))


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def sweep_configs(m: int) -> list:
    """The weight-only kernel's launch configurations `--sweep` tries at M rows."""
    from pagedserve.kernels.triton_fp8_gemv import GemvConfig, config_for

    configs = []
    if m <= 8:  # multiply-and-sum on the CUDA cores: <= 128 products per thread
        for block_n, block_k, warps in ((8, 512, 4), (16, 512, 4), (16, 256, 4), (32, 256, 8), (32, 128, 4)):
            if m * block_n * block_k // (32 * warps) <= 128:
                configs.append(GemvConfig(m, block_n, block_k, False, warps, 4))
    block_m = max(16, 1 << (m - 1).bit_length())
    for block_n, block_k, warps, stages in (
        (32, 256, 4, 4),
        (64, 256, 4, 4),
        (64, 128, 4, 4),
        (128, 128, 8, 3),
        (64, 512, 8, 3),
        (32, 512, 4, 3),
        (128, 256, 8, 3),
        (256, 128, 8, 3),
    ):
        configs.append(GemvConfig(block_m, block_n, block_k, True, warps, stages))
    table = config_for(m)  # and the table's own with split-K off, and with 8 splits
    configs += [dataclasses.replace(table, split_k=1), dataclasses.replace(table, split_k=8)]
    return configs


def gemv_sweep_configs(m: int, weight_dtype: torch.dtype) -> list:
    """The GEMV kernel's launch configurations `--sweep` tries at M rows (BLOCK_K in bytes of a
    weight row per step, so both weight dtypes get the same bytes per load)."""
    from pagedserve.kernels.triton_fp8_gemv import SplitKGemvConfig, gemv_config_for

    size = weight_dtype.itemsize
    configs = []
    for block_n, k_bytes, warps, stages, acc_2d in (
        (8, 512, 4, 4, True),
        (8, 512, 4, 2, True),
        (8, 512, 4, 1, True),
        (4, 512, 4, 4, True),
        (16, 512, 4, 4, True),
        (16, 512, 8, 3, True),
        (32, 512, 8, 3, True),
        (4, 1024, 4, 4, True),
        (8, 1024, 4, 3, True),
        (16, 256, 4, 4, True),
        (8, 512, 4, 4, False),
        (8, 256, 4, 4, False),
        (16, 256, 4, 3, False),
        (8, 512, 4, 6, True),  # deeper prefetch, for the small projections' few programs per SM
        (4, 1024, 4, 6, True),
        (16, 512, 4, 6, True),
        (8, 512, 8, 4, True),
        (4, 512, 2, 6, True),
    ):
        configs.append(SplitKGemvConfig(block_n, k_bytes // size, None, warps, stages, acc_2d))
    default = gemv_config_for(m, 1, 1, weight_dtype)  # the default table's, with 2 and 4 splits
    configs += [dataclasses.replace(default, split_k=2), dataclasses.replace(default, split_k=4)]
    return list(dict.fromkeys(configs))


def _calls(x: torch.Tensor, w_bf16: list, w_fp8: list) -> dict[str, list[Callable[[], object]]]:
    """Per path, one call per weight copy (see the module doc for the paths)."""
    from pagedserve.kernels import fp8, triton_fp8_gemv

    xq = fp8.quantize_per_token(x)
    mm, gemv = fp8.fp8_linear, triton_fp8_gemv.weight_only_linear
    calls = {
        "bf16": [lambda b=b: F.linear(x, b) for b in w_bf16],
        "mm": [lambda q=q, s=s: mm(xq, q, s, None, torch.bfloat16) for q, s in w_fp8],
        "mm+q": [
            lambda q=q, s=s: mm(fp8.quantize_per_token(x), q, s, None, torch.bfloat16) for q, s in w_fp8
        ],
        "w8a16": [lambda q=q, s=s: gemv(x, q, s, None, torch.bfloat16) for q, s in w_fp8],
    }
    if x.shape[0] <= triton_fp8_gemv.GEMV_MAX_M:
        calls["gemv16"] = [lambda b=b: triton_fp8_gemv.linear_16bit(x, b) for b in w_bf16]
    return calls


def bench_shapes(
    device: torch.device,
    scale: int,
    sweep: bool,
    copy_bps: float,
    shapes: list[str] | None = None,
    m_values: tuple[int, ...] = M_VALUES,
) -> tuple[list[dict], list[dict]]:
    from pagedserve.kernels import fp8, triton_fp8_gemv

    cuda = device.type == "cuda"
    rows, sweeps = [], []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in projection_shapes(scale).items():
        if shapes and name not in shapes:
            continue
        w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
        wq, ws = fp8.quantize_weight(w)
        bf16_bytes, fp8_bytes = 2 * n * k, n * k + 4 * n
        copies_bf16, copies_fp8 = _copies(bf16_bytes, device), _copies(fp8_bytes, device)
        w_bf16 = [w] + [w.clone() for _ in range(copies_bf16 - 1)]
        w_fp8 = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies_fp8 - 1)]
        del w
        for m in m_values:
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            t = {path: time_per_call(calls, device) for path, calls in _calls(x, w_bf16, w_fp8).items()}
            want = fp8.weight_only_linear_reference(x, wq, ws, None, torch.float32)
            err = _rel_error(triton_fp8_gemv.weight_only_linear(x, wq, ws, None, torch.bfloat16), want)
            scaled = t["mm"] if FUSED_QUANT_INPUT[name] else t["mm+q"]
            row = dict(shape=name, n=n, k=k, m=m)
            for path, seconds in t.items():
                nbytes = bf16_bytes if path in ("bf16", "gemv16") else fp8_bytes
                row[f"{path} us"] = seconds * 1e6
                row[f"{path} GB/s"] = nbytes / seconds / 1e9
                row[f"{path} frac"] = nbytes / seconds / copy_bps
            row["w8a16 vs bf16"] = t["bf16"] / t["w8a16"]
            row["w8a16 vs scaled"] = scaled / t["w8a16"]
            row["winner"] = "w8a16" if t["w8a16"] < scaled else ("mm" if FUSED_QUANT_INPUT[name] else "mm+q")
            row["w8a16 rel err"] = err
            if "gemv16" in t:
                row["gemv16 vs bf16"] = t["bf16"] / t["gemv16"]
            rows.append(row)
            gemv16 = f", gemv16 {t['gemv16'] * 1e6:8.1f} ({row['gemv16 frac']:.2f})" if "gemv16" in t else ""
            print(
                f"{name:8s} M={m:3d}: bf16 {t['bf16'] * 1e6:8.1f} us ({row['bf16 frac']:.2f}), "
                f"mm {t['mm'] * 1e6:8.1f}, mm+q {t['mm+q'] * 1e6:8.1f}, w8a16 {t['w8a16'] * 1e6:8.1f} "
                f"({row['w8a16 frac']:.2f} of copy bw){gemv16}; err {err:.1e}",
                flush=True,
            )
            if sweep and m in SWEEP_GEMV_M and m <= triton_fp8_gemv.GEMV_MAX_M:
                ctx = dict(shape=name, m=m, x=x, copy_bps=copy_bps, device=device)
                sweeps.append(_sweep_gemv(**ctx, weights=w_fp8, nbytes=fp8_bytes, t=t, want=want))
                want16 = F.linear(x.float(), w_bf16[0].float())
                sweeps.append(_sweep_gemv(**ctx, weights=w_bf16, nbytes=bf16_bytes, t=t, want=want16))
            elif sweep and m > triton_fp8_gemv.GEMV_MAX_M:
                sweeps.append(_sweep_one(name, m, x, w_fp8, fp8_bytes, copy_bps, t["w8a16"], want, device))
        del w_bf16, w_fp8
        if cuda:
            torch.cuda.empty_cache()
    return rows, sweeps


def _sweep_one(name, m, x, w_fp8, fp8_bytes, copy_bps, table_s, want, device) -> dict:
    """The fastest of `sweep_configs(m)` for one shape and M (those that fail to compile or are
    wrong are skipped), against the table's."""
    from pagedserve.kernels import triton_fp8_gemv

    best = ("table", table_s)
    for config in sweep_configs(m):

        def call(q, s, config=config):
            return triton_fp8_gemv.weight_only_linear(x, q, s, None, torch.bfloat16, config)

        try:
            if _rel_error(call(*w_fp8[0]), want) > 1e-2:
                print(f"  sweep {name} M={m} {config}: wrong result, skipped")
                continue
            seconds = time_per_call([lambda q=q, s=s: call(q, s) for q, s in w_fp8], device)
        except Exception as exc:  # noqa: BLE001 - out of shared memory / registers for this tile
            print(f"  sweep {name} M={m} {config}: {type(exc).__name__}")
            continue
        if seconds < best[1]:
            best = (_describe(config), seconds)
    return dict(
        shape=name, m=m, table_us=table_s * 1e6, best_us=best[1] * 1e6, best=best[0],
        best_frac=fp8_bytes / best[1] / copy_bps,
    )  # fmt: skip


def _sweep_gemv(shape, m, x, weights, nbytes, t, want, copy_bps, device) -> dict:
    """The fastest of `gemv_sweep_configs` for one shape, M and weight dtype (FP8 weights: `weights`
    holds (e4m3, scale) pairs; bf16: the tensors), beside cuBLAS bf16 and, for FP8, the tiled
    kernel's table entry and the shipped table (`w8a16`)."""
    from pagedserve.kernels import triton_fp8_gemv

    is_fp8 = isinstance(weights[0], tuple)
    dtype = weights[0][0].dtype if is_fp8 else weights[0].dtype
    n, k = (weights[0][0] if is_fp8 else weights[0]).shape

    def bound(config):
        if is_fp8:
            return [
                lambda q=q, s=s: triton_fp8_gemv.gemv(x, q, s, None, torch.bfloat16, config)
                for q, s in weights
            ]
        return [lambda w=w: triton_fp8_gemv.gemv(x, w, None, None, torch.bfloat16, config) for w in weights]

    row = dict(
        shape=shape,
        m=m,
        weights="fp8" if is_fp8 else "bf16",
        cublas_bf16_frac=nbytes_frac(2 * n * k, t["bf16"], copy_bps),
    )
    if is_fp8:
        tiled = triton_fp8_gemv.config_for(m)
        calls = [lambda q=q, s=s: triton_fp8_gemv.weight_only_linear(x, q, s, None, torch.bfloat16, tiled)
                 for q, s in weights]  # fmt: skip
        row["tiled_frac"] = nbytes_frac(nbytes, time_per_call(calls, device), copy_bps)
    table = triton_fp8_gemv.gemv_config_for(m, n, k, dtype)
    table_s = time_per_call(bound(table), device)
    row["table_us"], row["table_frac"] = table_s * 1e6, nbytes_frac(nbytes, table_s, copy_bps)
    best = (table, table_s)
    for config in gemv_sweep_configs(m, dtype):
        try:
            if _rel_error(bound(config)[0](), want) > 1e-2:
                print(f"  sweep {shape} M={m} {row['weights']} {config.describe()}: wrong result, skipped")
                continue
            seconds = time_per_call(bound(config), device)
        except Exception as exc:  # noqa: BLE001 - out of shared memory / registers for this tile
            print(f"  sweep {shape} M={m} {row['weights']} {config.describe()}: {type(exc).__name__}")
            continue
        print(
            f"  sweep {shape:8s} M={m} {row['weights']:4s} {config.describe():40s} {seconds * 1e6:8.2f} us "
            f"({nbytes_frac(nbytes, seconds, copy_bps):.2f})",
            flush=True,
        )
        if seconds < best[1]:
            best = (config, seconds)
    row["best_us"], row["best_frac"] = best[1] * 1e6, nbytes_frac(nbytes, best[1], copy_bps)
    row["best"] = best[0].describe()
    kind = "fp8" if is_fp8 else "16bit"
    row["table_entry"] = f"({kind!r}, {m}, {n}, {k}): {best[0]!r},"
    return row


def nbytes_frac(nbytes: int, seconds: float, copy_bps: float) -> float:
    """Bytes read per second over the copy bandwidth."""
    return nbytes / seconds / copy_bps


def _describe(config) -> str:
    """A GemvConfig in a table cell: the inner product, tiles, warps, stages, split."""
    kind = "dot" if config.use_dot else "sum"
    split = "auto" if config.split_k is None else config.split_k
    return (
        f"{kind} m{config.block_m} n{config.block_n} k{config.block_k} "
        f"w{config.num_warps} s{config.num_stages} split {split}"
    )


def bf16_gemv_threshold(rows: list[dict]) -> int:
    """The largest M up to which the GEMV kernel on bf16 weights beats cuBLAS on every shape."""
    best = 0
    for m in sorted({r["m"] for r in rows if "gemv16 us" in r}):
        if all(r["gemv16 us"] < r["bf16 us"] for r in rows if r["m"] == m):
            best = m
        else:
            break
    return best


def threshold(rows: list[dict]) -> int:
    """The largest M in M_VALUES up to which the weight-only kernel wins on every projection that
    is FP8 in the model (lm_head stays in the model dtype); 0 if it never does."""
    best = 0
    for m in M_VALUES:
        if all(r["winner"] == "w8a16" for r in rows if r["m"] == m and r["shape"] != "lm_head"):
            best = m
        else:
            break
    return best


def _cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n{title}\n" + markdown_table(columns, [[_cell(r[c]) for c in columns] for r in rows]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (N and K / 256)")
    parser.add_argument("--sweep", action="store_true", help="also time other weight-only configurations")
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--shapes", default="", help="comma-separated subset (qkv,o,gate_up,down,lm_head)")
    parser.add_argument("--m", default="", help="comma-separated M values (default 1,2,4,...,64)")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s] or None
    m_values = tuple(int(m) for m in args.m.split(",") if m) or M_VALUES
    device = torch.device(args.device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("off the GPU the Triton kernel needs TRITON_INTERPRET=1 (set it before starting)")
    scale = 256 if args.quick else 1
    copy_bps = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    print(f"device-to-device copy: {copy_bps / 1e12:.3f} TB/s (read + write)", flush=True)
    rows, sweeps = bench_shapes(device, scale, args.sweep, copy_bps, shapes, m_values)
    columns = ["shape", "m", "bf16 us", "mm us", "mm+q us", "w8a16 us", "bf16 frac", "mm frac", "w8a16 frac"]
    columns += ["w8a16 vs bf16", "w8a16 vs scaled", "winner"]
    for r in rows:  # the bf16 GEMV only where it ran
        r.setdefault("gemv16 us", float("nan"))
        r.setdefault("gemv16 frac", float("nan"))
    columns += ["gemv16 us", "gemv16 frac"]
    name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run: times mean nothing)"
    )
    print_table(
        f"{name}: us per call, fraction of the copy bandwidth ({copy_bps / 1e12:.3f} TB/s)", rows, columns
    )
    suggested = threshold(rows)
    print(f"\nweight-only wins on every FP8 projection up to M = {suggested} (WEIGHT_ONLY_MAX_M)")
    suggested16 = bf16_gemv_threshold(rows)
    print(f"the bf16 GEMV beats cuBLAS on every shape up to M = {suggested16} (BF16_GEMV_MAX_M)")
    gemv_sweeps = [r for r in sweeps if "table_entry" in r]
    tiled_sweeps = [r for r in sweeps if "table_entry" not in r]
    if gemv_sweeps:
        columns = ["shape", "m", "weights", "cublas_bf16_frac", "tiled_frac", "table_us", "table_frac"]
        columns += ["best_us", "best_frac", "best"]
        for r in gemv_sweeps:
            r.setdefault("tiled_frac", float("nan"))
        print_table("GEMV configurations (M <= GEMV_MAX_M): table vs best of the sweep", gemv_sweeps, columns)
        print("\nGEMV_TABLE entries (kernels/triton_fp8_gemv.py):")
        for r in gemv_sweeps:
            print(f"    {r['table_entry']}  # {r['shape']}: {r['best_frac']:.2f} of copy bw")
    if tiled_sweeps:
        print_table(
            "weight-only configurations: table vs best of the sweep", tiled_sweeps, list(tiled_sweeps[0])
        )
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        result = dict(
            device=name,
            copy_bytes_per_s=copy_bps,
            rows=rows,
            sweep=sweeps,
            suggested_weight_only_max_m=suggested,
            suggested_bf16_gemv_max_m=suggested16,
        )
        args.result_file.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
