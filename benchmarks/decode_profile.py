"""Where a small-batch decode step's GPU time goes, against what it must read (on a GPU).

    python -m benchmarks.decode_profile [--quantization fp8] [--batches 1,8,32] [--result-file F]

The llama-8b-shape model (32 layers, random weights made on the device as `benchmarks.step
--init-on-device` makes them; `--quantization fp8` quantizes them as the loader does) behind a
`ModelRunner` that captures its decode CUDA graphs. For each batch B, B prompts of `--context`
tokens are prefilled, then:

* graph vs eager: `--steps` decode steps driven one plan ahead (as the service drives them), wall
  ms per step, with the CUDA graphs and without;
* profile: `--replays` graph steps under the torch profiler, kernel time per step summed by kind
  (GEMM, attention, norm, rotary, activation, quantize, sampling, copy, other) and the kernel count;
* floor: the bytes a step must read (`CausalLM.decode_read_bytes`: every weight as loaded, the
  embedding table excepted, plus B x context x KV bytes per token) over a device-to-device copy's
  bandwidth the runner measured when it started (`executor.profiling.measure_copy_bandwidth`, the
  figure an executor reports for `pagedserve bench`'s floor).

The graphs are captured for the shape's whole context, as an executor's are (`--max-model-len`):
their block tables are that wide, and the attention's split plan follows from it.

The issue-33 targets are ratios of the per-token latency to this floor (1.15x for bf16 at one
request). `--device cpu` runs the script on a tiny model (2 layers of a narrowed shape) as a
smoke test: its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.step import model_on_device, prefill, run_direct
from pagedserve.common.tables import markdown_table
from pagedserve.executor.config import KV_CACHE_DTYPES, QUANTIZATIONS, ExecutorConfig
from pagedserve.executor.runner import ModelRunner
from pagedserve.model_shapes import SHAPES

# Kernel-name fragments of each kind, first match wins (cuBLAS names vary by release). The
# weight-only FP8 kernel and its split-K reduce count as GEMM.
KINDS = (
    (
        "GEMM",
        ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "_weight_only_kernel", "split_k_reduce", "splitk"),
    ),
    ("attention", ("decode_kernel", "varlen_kernel", "paged", "attention", "write_kv", "fp8_decode")),
    ("quantize", ("_quant_kernel", "quant")),
    ("norm", ("rms",)),
    ("rotary", ("rotary",)),
    ("activation", ("silu", "gelu")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "exponential", "sampl", "gumbel")),
    ("copy", ("memcpy", "memset")),
)


def kind_of(kernel_name: str) -> str:
    low = kernel_name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile_kinds(runner: ModelRunner, plans: list) -> tuple[dict[str, float], int, list[dict]]:
    """(ms per step by kind, kernels per step, every kernel name with its launches and ms per step,
    costliest first) of running `plans` one by one under the profiler (CUDA graph replays show
    their kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for plan in plans:
            runner.execute(plan)
        torch.cuda.synchronize()
    kinds: dict[str, float] = defaultdict(float)
    names: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    count = 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = (event.time_range.end - event.time_range.start) / 1000 / len(plans)
        kinds[kind_of(event.name)] += ms
        names[event.name[:80]] += ms
        launches[event.name[:80]] += 1
        count += 1
    per_step = [
        {
            "kernel": name,
            "launches": launches[name] / len(plans),
            "ms": ms,
            "µs each": 1000 * ms * len(plans) / launches[name],
        }
        for name, ms in sorted(names.items(), key=lambda kv: -kv[1])
    ]
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1])), count // len(plans), per_step


def _steps_ms(runner: ModelRunner, sched, steps: int) -> float:
    wall, _, _ = run_direct(runner, [sched.plan() for _ in range(steps)], events=False)
    return 1000 * wall / steps


def main(argv: list[str] | None = None) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per mode")
    parser.add_argument("--replays", type=int, default=5, help="graph steps under the profiler")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--max-model-len", type=int, default=None,
        help="the context the CUDA graphs are captured for (their block tables' width, which sets the "
        "attention's split plan); default: the shape's, as an executor takes it",
    )  # fmt: skip
    parser.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q], default=None)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/llama-8b-shape-profile"))
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = dataclasses.replace(SHAPES["llama-8b"], num_hidden_layers=args.layers)
    if not cuda:  # the smoke run: a narrow model the CPU builds in seconds
        shape = dataclasses.replace(
            shape, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, num_hidden_layers=min(args.layers, 2),
        )  # fmt: skip
    directory = args.model_dir / f"{shape.num_hidden_layers}l-{shape.hidden_size}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape.hf_config(1, 2), indent=2))
    max_len = args.max_model_len or (shape.max_position_embeddings if cuda else 1024)
    if max_len < args.context + args.steps * 3 + args.replays + 64:
        parser.error(f"--max-model-len {max_len} is too short for --context {args.context}")
    config = ExecutorConfig(
        model=str(directory), device=args.device, max_model_len=max_len, max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, args.context), gpu_memory_utilization=0.85, swap_space=0,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        num_gpu_blocks_override=None if cuda else max(batches) * (max_len // 16 + 2),
    )  # fmt: skip
    t0 = time.perf_counter()
    model = model_on_device(directory, max_len, device, args.quantization)
    runner = ModelRunner.from_model(config, model)
    graphs = runner.graphs
    copy_bps = runner.copy_bytes_per_s  # what the executor measured at start (and reports on attach)
    print(
        f"runner ready in {time.perf_counter() - t0:.1f} s; copy bandwidth {copy_bps / 1e12:.3f} TB/s "
        f"(read + write); weights read per step {runner.weight_read_bytes / 1e9:.2f} GB "
        f"({args.quantization or 'bf16'}), KV {runner.kv_bytes_per_token} B/token",
        flush=True,
    )
    rows, kind_rows, tops = [], [], {}
    for batch in batches:
        sched = prefill(runner, batch, args.context, config.max_num_batched_tokens)
        context = args.context + args.steps  # the middle of what the timed steps see
        read = runner.weight_read_bytes + batch * context * runner.kv_bytes_per_token
        floor_ms = 1000 * read / copy_bps if copy_bps else None
        row: dict = {"batch": batch, "read GB": read / 1e9, "floor ms": floor_ms}
        for mode in ("graphs", "eager") if graphs is not None else ("eager",):
            runner.graphs = graphs if mode == "graphs" else None
            row[f"{mode} ms/step"] = _steps_ms(runner, sched, args.steps)
        runner.graphs = graphs
        if cuda:
            kinds, count, top = profile_kinds(runner, [sched.plan() for _ in range(args.replays)])
            row["kernel ms/step"] = sum(kinds.values())
            row["kernels/step"] = count
            kind_rows.append({"batch": batch, **kinds})
            tops[batch] = top
        best = row.get("graphs ms/step", row["eager ms/step"])
        row["step / floor"] = best / floor_ms if floor_ms else None
        row["kernels / floor"] = (
            row["kernel ms/step"] / floor_ms if floor_ms and "kernel ms/step" in row else None
        )
        rows.append(row)
        print(row, flush=True)
    weights = args.quantization or "bf16"
    label = f"{weights} weights, KV {args.kv_cache_dtype}, {shape.num_hidden_layers} layers"
    if not cuda:
        label += " (CPU smoke run: times mean nothing)"
    _print(f"decode steps, context ~{args.context + args.steps}, {label}", rows)
    if kind_rows:
        _print("kernel ms per graph step, by kind", kind_rows)
        for batch, kernels in tops.items():
            _print(f"batch {batch}: every kernel of a graph step, costliest first", kernels)
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        result = dict(
            config=vars(args) | {"model_dir": str(args.model_dir), "result_file": str(args.result_file)}
        )
        result |= dict(copy_bytes_per_s=copy_bps, weight_read_bytes=runner.weight_read_bytes)
        result |= dict(kv_bytes_per_token=runner.kv_bytes_per_token, steps=rows, kinds=kind_rows, top=tops)
        args.result_file.write_text(json.dumps(result, indent=1, default=str))


def _print(title: str, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    print(f"\n{title}\n" + markdown_table(columns, cells))


def _cell(value: object) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
