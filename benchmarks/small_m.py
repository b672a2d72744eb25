"""Small-M projections (decode at 1..64 tokens): bf16 cuBLAS, FP8 `_scaled_mm` and the FP8
weight-only kernel, against the weight-read floor measured in the same run (on a GPU).

    python -m benchmarks.small_m [--sweep] [--result-file bench-results/small-m.json]

For the llama-8b-shape projections (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down
14336->4096, lm_head 4096->128256) at M = 1, 2, 4, 8, 16, 32, 64:

* `bf16`: `F.linear` (cuBLAS) on bf16 weights;
* `mm`: `torch._scaled_mm` with row-wise scales on activations already quantized (what qkv,
  gate_up and down get from the fused quantizing norm / SiLU kernels), and `mm+q`: with the
  single-pass per-token quantization before it (what o_proj pays);
* `w8a16`: the weight-only kernel (`kernels.triton_fp8_gemv`, its shipped table).

Each time is one call's share of a CUDA graph that calls the projection on enough distinct
copies of its weights (>= 512 MB per replay, ten times the H200's L2) that every call reads its
weights from HBM, as a decode step does (32 layers of different weights); the median of the
replays. GB/s counts the weight bytes (bf16: 2 per element, FP8: 1 plus the scales) over that
time, `frac` is that rate over the device-to-device copy bandwidth measured at the start of the
run (2 x bytes / time, read + write, as WORKLOADS.md quotes it). `winner` is the faster FP8 path,
`mm` for the shapes whose input comes quantized from a fused kernel, `mm+q` for o_proj;
`executor.quantization.WEIGHT_ONLY_MAX_M` is to be set to the largest M where `w8a16` wins on
every shape. `--sweep` also times other launch configurations of the weight-only kernel per shape
and M and prints the best, to set `triton_fp8_gemv.CONFIG_TABLE`.

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


def _calls(x: torch.Tensor, w_bf16: list, w_fp8: list) -> dict[str, list[Callable[[], object]]]:
    """Per path, one call per weight copy (see the module doc for the paths)."""
    from pagedserve.kernels import fp8, triton_fp8_gemv

    xq = fp8.quantize_per_token(x)
    mm, gemv = fp8.fp8_linear, triton_fp8_gemv.weight_only_linear
    return {
        "bf16": [lambda b=b: F.linear(x, b) for b in w_bf16],
        "mm": [lambda q=q, s=s: mm(xq, q, s, None, torch.bfloat16) for q, s in w_fp8],
        "mm+q": [
            lambda q=q, s=s: mm(fp8.quantize_per_token(x), q, s, None, torch.bfloat16) for q, s in w_fp8
        ],
        "w8a16": [lambda q=q, s=s: gemv(x, q, s, None, torch.bfloat16) for q, s in w_fp8],
    }


def bench_shapes(
    device: torch.device, scale: int, sweep: bool, copy_bps: float
) -> tuple[list[dict], list[dict]]:
    from pagedserve.kernels import fp8, triton_fp8_gemv

    cuda = device.type == "cuda"
    rows, sweeps = [], []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in projection_shapes(scale).items():
        w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
        wq, ws = fp8.quantize_weight(w)
        bf16_bytes, fp8_bytes = 2 * n * k, n * k + 4 * n
        copies_bf16, copies_fp8 = _copies(bf16_bytes, device), _copies(fp8_bytes, device)
        w_bf16 = [w] + [w.clone() for _ in range(copies_bf16 - 1)]
        w_fp8 = [(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies_fp8 - 1)]
        del w
        for m in M_VALUES:
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            t = {path: time_per_call(calls, device) for path, calls in _calls(x, w_bf16, w_fp8).items()}
            want = fp8.weight_only_linear_reference(x, wq, ws, None, torch.float32)
            err = _rel_error(triton_fp8_gemv.weight_only_linear(x, wq, ws, None, torch.bfloat16), want)
            scaled = t["mm"] if FUSED_QUANT_INPUT[name] else t["mm+q"]
            row = dict(shape=name, n=n, k=k, m=m)
            for path, seconds in t.items():
                nbytes = bf16_bytes if path == "bf16" else fp8_bytes
                row[f"{path} us"] = seconds * 1e6
                row[f"{path} GB/s"] = nbytes / seconds / 1e9
                row[f"{path} frac"] = nbytes / seconds / copy_bps
            row["w8a16 vs bf16"] = t["bf16"] / t["w8a16"]
            row["w8a16 vs scaled"] = scaled / t["w8a16"]
            row["winner"] = "w8a16" if t["w8a16"] < scaled else ("mm" if FUSED_QUANT_INPUT[name] else "mm+q")
            row["w8a16 rel err"] = err
            rows.append(row)
            print(
                f"{name:8s} M={m:3d}: bf16 {t['bf16'] * 1e6:8.1f} us, mm {t['mm'] * 1e6:8.1f}, "
                f"mm+q {t['mm+q'] * 1e6:8.1f}, w8a16 {t['w8a16'] * 1e6:8.1f} "
                f"({row['w8a16 frac']:.2f} of copy bw); err {err:.1e}",
                flush=True,
            )
            if sweep:
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


def _describe(config) -> str:
    """A GemvConfig in a table cell: the inner product, tiles, warps, stages, split."""
    kind = "dot" if config.use_dot else "sum"
    split = "auto" if config.split_k is None else config.split_k
    return (
        f"{kind} m{config.block_m} n{config.block_n} k{config.block_k} "
        f"w{config.num_warps} s{config.num_stages} split {split}"
    )


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
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("off the GPU the Triton kernel needs TRITON_INTERPRET=1 (set it before starting)")
    scale = 256 if args.quick else 1
    copy_bps = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    print(f"device-to-device copy: {copy_bps / 1e12:.3f} TB/s (read + write)", flush=True)
    rows, sweeps = bench_shapes(device, scale, args.sweep, copy_bps)
    columns = ["shape", "m", "bf16 us", "mm us", "mm+q us", "w8a16 us", "bf16 frac", "mm frac", "w8a16 frac"]
    columns += ["w8a16 vs bf16", "w8a16 vs scaled", "winner"]
    name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run: times mean nothing)"
    )
    print_table(
        f"{name}: us per call, fraction of the copy bandwidth ({copy_bps / 1e12:.3f} TB/s)", rows, columns
    )
    suggested = threshold(rows)
    print(f"\nweight-only wins on every FP8 projection up to M = {suggested} (WEIGHT_ONLY_MAX_M)")
    if sweeps:
        print_table("weight-only configurations: table vs best of the sweep", sweeps, list(sweeps[0]))
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        result = dict(
            device=name,
            copy_bytes_per_s=copy_bps,
            rows=rows,
            sweep=sweeps,
            suggested_weight_only_max_m=suggested,
        )
        args.result_file.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
