"""Where a step's GPU time goes, on CUDA: the numbers behind the W1 analysis
(benchmarks/results/2026-11-29-h200-s4/README.md).

    python -m benchmarks.breakdown                 # all three parts, about a minute on an H200

* gemm: bf16 `F.linear` throughput of the llama-8b-shape projections (qkv, o, gate_up, down,
  lm_head) for M = 64 .. 8192 rows, and the matmul cost per token of the 32 layers at each M.
* steps: eager steps of the 32-layer model (decode batches, decode plus a 512-token prompt,
  whole prompts) under the torch profiler, their kernel time summed by kind (matmul, decode
  attention, varlen attention, norms, ...).
* overlap: layer matmuls on one CUDA stream and decode attention on another, against running them
  one after the other: what two-stream overlap of compute- and memory-bound work would win; then
  the same with the SMs split between them (CUDA green contexts).

Prints markdown tables; `--result-file` also writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.ahead_plans import AheadScheduler
from benchmarks.step import mixed_plans, model_on_device, prefill, prompts, write_model
from pagedserve import kernels
from pagedserve.common.tables import markdown_table
from pagedserve.executor.config import KV_CACHE_DTYPES, QUANTIZATIONS, ExecutorConfig
from pagedserve.executor.runner import ModelRunner
from pagedserve.model_shapes import SHAPES

PARTS = ("gemm", "steps", "overlap")
LAYERS = 32
OVERLAP_LAYERS = 8
M_VALUES = (64, 128, 256, 384, 512, 768, 1024, 2048, 4096, 8192)
# Kernel name fragments of each kind (cuBLAS names vary by release: sm90_xmma, nvjet, cutlass...).
KINDS = (
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "sm90", "_weight_only_kernel", "split_k_reduce")),
    ("attention decode", ("decode_kernel",)),
    ("attention varlen", ("varlen_kernel",)),
    ("write_kv", ("write_kv",)),
    ("rms_norm", ("rms",)),
    ("rotary", ("rotary",)),
    ("silu_mul", ("silu",)),
    ("quantize", ("_quant_kernel",)),  # FP8: the per-token pass before o_proj (the fused ones are above)
    ("moe gate_up", ("_gate_up_kernel",)),  # kernels.triton_moe
    ("moe down", ("_down_kernel",)),
    ("moe align", ("_align_",)),
    ("moe combine", ("_sum_top_k_kernel",)),
)


def projection_shapes() -> dict[str, tuple[int, int]]:
    """(out, in) features of the llama-8b-shape matmuls."""
    s = SHAPES["llama-8b"]
    head_dim = s.hidden_size // s.num_attention_heads
    qkv = (s.num_attention_heads + 2 * s.num_key_value_heads) * head_dim
    return {
        "qkv": (qkv, s.hidden_size),
        "o": (s.hidden_size, s.num_attention_heads * head_dim),
        "gate_up": (2 * s.intermediate_size, s.hidden_size),
        "down": (s.hidden_size, s.intermediate_size),
        "lm_head": (s.vocab_size, s.hidden_size),
    }


def gemm_table(device: torch.device) -> list[dict]:
    weights = {
        name: torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for name, (n, k) in projection_shapes().items()
    }
    rows = []
    for m in M_VALUES:
        row: dict = {"M": m}
        layer_ms = 0.0
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], device=device, dtype=torch.bfloat16)
            ms = triton.testing.do_bench(lambda x=x, w=w: F.linear(x, w), warmup=20, rep=100)
            row[name] = 2 * m * w.shape[0] * w.shape[1] / ms / 1e9  # TFLOP/s
            if name != "lm_head":
                layer_ms += ms
        row["layers µs/token"] = 1000 * LAYERS * layer_ms / m
        rows.append(row)
    return rows


def _kind(kernel_name: str) -> str:
    low = kernel_name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile_steps(runner: ModelRunner, plans: list) -> dict[str, float]:
    """Kernel time per kind, ms per step, of running `plans` eagerly."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for plan in plans:
            runner.execute(plan)
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[_kind(event.name)] += (event.time_range.end - event.time_range.start) / 1000 / len(plans)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def step_breakdown(
    device: torch.device,
    model_dir: Path,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    model: Path | None = None,
) -> list[dict]:
    """Kernel time by kind of decode, mixed and prefill steps: of the 32-layer llama-8b shape, or
    of `model`'s config (any family; random weights, as --load-format dummy draws them)."""
    directory = model or write_model(model_dir / f"{LAYERS}l", LAYERS, False, device)
    config = ExecutorConfig(
        model=str(directory), max_model_len=2048, max_num_seqs=512, max_num_batched_tokens=8192,
        gpu_memory_utilization=0.85, swap_space=0, enforce_eager=True, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    runner = ModelRunner.from_model(config, model_on_device(directory, 2048, device, quantization))
    rows = []
    for batch, context in ((256, 512), (512, 800)):
        sched = prefill(runner, batch, context, 8192)
        rows.append(
            {"step": f"decode {batch} x {context}", **profile_steps(runner, [sched.plan() for _ in range(5)])}
        )
        rows.append(
            {
                "step": f"decode {batch} x {context} + 512-token prompt",
                **profile_steps(runner, mixed_plans(sched, 5, 512)),
            }
        )
    for num, length in ((16, 512), (4, 2048)):
        runner.reset()
        sched = AheadScheduler(runner.kv_cache.num_device_blocks, runner.block_size, 8192, 512)
        for seq_id, prompt in prompts(num, length).items():
            sched.add(seq_id, prompt)
        rows.append({"step": f"prompts {num} x {length}", **profile_steps(runner, [sched.plan()])})
    return rows


@dataclass
class LayerWork:
    """`len(attention)` layers of a decode step: the matmuls at M rows (the same weights for every
    layer) and decode attention over batch x context tokens of random KV (a cache per layer)."""

    matmuls: Callable[[], None]  # one layer's four projections
    attention: list[Callable[[], None]]  # one call per layer

    def all_matmuls(self) -> None:
        for _ in self.attention:
            self.matmuls()

    def all_attention(self) -> None:
        for attend in self.attention:
            attend()


def layer_work(
    device: torch.device, weights: list[torch.Tensor], batch: int, context: int, m: int
) -> LayerWork:
    s = SHAPES["llama-8b"]
    heads, kv_heads = s.num_attention_heads, s.num_key_value_heads
    head_dim, block_size = s.hidden_size // heads, 16
    width = context // block_size + 1
    num_blocks = batch * width
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, width)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    cu_seqlens = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
    xs = [torch.randn(m, w.shape[1], device=device, dtype=torch.bfloat16) for w in weights]

    def matmuls() -> None:
        for x, w in zip(xs, weights, strict=True):
            F.linear(x, w)

    def attend_over(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Callable[[], None]:
        return lambda: kernels.paged_attention(
            q, k_cache, v_cache, tables, seq_lens, cu_seqlens, head_dim**-0.5
        )

    shape = (num_blocks, block_size, kv_heads, head_dim)
    attention = [
        attend_over(
            torch.randn(shape, device=device, dtype=torch.bfloat16),
            torch.randn(shape, device=device, dtype=torch.bfloat16),
        )
        for _ in range(OVERLAP_LAYERS)
    ]
    return LayerWork(matmuls, attention)


def _matmul_weights(device: torch.device) -> list[torch.Tensor]:
    shapes = [shape for name, shape in projection_shapes().items() if name != "lm_head"]
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) for n, k in shapes]


def _on(stream: torch.cuda.Stream, *work: Callable[[], None]) -> None:
    """Runs `work` on `stream`, ordered after what the current stream queued before."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in work:
            w()


def _join(*streams: torch.cuda.Stream) -> None:
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)


def _time_together(*pairs: tuple[torch.cuda.Stream, Callable[[], None]]) -> float:
    """ms of running each (stream, work) pair at once, joined at the end."""

    def run() -> None:
        for stream, work in pairs:
            _on(stream, work)
        _join(*(stream for stream, _ in pairs))

    run()
    torch.cuda.synchronize()
    return triton.testing.do_bench(run, rep=40)


def overlap_table(device: torch.device) -> list[dict]:
    """Per case: the matmuls and the decode attention of OVERLAP_LAYERS layers, timed alone, one
    after the other, and on two streams interleaved layer by layer (as two micro-batches would)."""
    weights = _matmul_weights(device)
    attention_stream, matmul_stream = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []
    for batch, context, m in ((256, 800, 256), (512, 800, 512), (256, 512, 768), (128, 1000, 128)):
        work = layer_work(device, weights, batch, context, m)

        def serial(work=work) -> None:
            for attend in work.attention:
                work.matmuls()
                attend()

        def two_streams(work=work) -> None:
            for attend in work.attention:
                _on(attention_stream, attend)
                _on(matmul_stream, work.matmuls)
            _join(attention_stream, matmul_stream)

        serial()
        torch.cuda.synchronize()
        timings = {
            "matmuls ms": triton.testing.do_bench(work.all_matmuls, rep=50),
            "attention ms": triton.testing.do_bench(work.all_attention, rep=50),
            "serial ms": triton.testing.do_bench(serial, rep=50),
            "two streams ms": triton.testing.do_bench(two_streams, rep=50),
        }
        timings["saved"] = 1 - timings["two streams ms"] / timings["serial ms"]
        rows.append({"batch x context": f"{batch} x {context}", "M": m, **timings})
    return rows


def green_context_table(device: torch.device) -> list[dict]:
    """SM partitioning instead of streams: a decode step of 512 x 800 split into two micro-batches
    of 256, one's attention on `a` SMs (a green context) while the other's matmuls run on `b`.
    Two such rounds replace the full batch's matmuls and attention run one after the other."""
    weights = _matmul_weights(device)
    half, full = layer_work(device, weights, 256, 800, 256), layer_work(device, weights, 512, 800, 512)
    half.all_attention()
    full.all_attention()
    torch.cuda.synchronize()
    serial_full = triton.testing.do_bench(lambda: (full.all_matmuls(), full.all_attention()), rep=40)
    rows = []
    for attention_sms, matmul_sms in ((32, 96), (48, 80), (64, 64)):
        # The contexts must outlive their streams' work: keep them referenced through the iteration.
        contexts = [
            torch.cuda.green_contexts.GreenContext.create(num_sms=n, device_id=device.index or 0)
            for n in (attention_sms, matmul_sms)
        ]
        attention_stream, matmul_stream = (context.Stream() for context in contexts)
        both = _time_together((attention_stream, half.all_attention), (matmul_stream, half.all_matmuls))
        rows.append({
            "SMs attention / matmuls": f"{attention_sms} / {matmul_sms}",
            "attention alone ms": _time_together((attention_stream, half.all_attention)),
            "matmuls alone ms": _time_together((matmul_stream, half.all_matmuls)),
            "concurrent ms": both,
            "two rounds ms": 2 * both,
            "full batch serial ms": serial_full,
            "saved": 1 - 2 * both / serial_full,
        })  # fmt: skip
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(c, 0.0)) for c in columns] for row in rows]
    print(f"\n{title}\n" + markdown_table(columns, cells))


def _cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("parts", nargs="*", help=f"any of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/llama-8b-shape-breakdown"))
    parser.add_argument(
        "--model", type=Path, default=None,
        help="steps part: this model directory's config (e.g. make-model --shape qwen3-30b-a3b "
        "--no-weights) instead of the llama-8b shape; random weights",
    )  # fmt: skip
    parser.add_argument("--result-file", type=Path, default=None)
    quantizations = [q for q in QUANTIZATIONS if q]
    parser.add_argument("--quantization", choices=quantizations, default=None, help="steps part: FP8 weights")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="steps part")
    args = parser.parse_args(argv)
    args.parts = args.parts or PARTS
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    device = torch.device("cuda")
    results = {}
    if "gemm" in args.parts:
        results["gemm"] = gemm_table(device)
        print_table(
            "bf16 matmul TFLOP/s by rows M (layers µs/token: the 32 layers' matmuls per token)",
            results["gemm"],
        )
    if "overlap" in args.parts:
        results["overlap"] = overlap_table(device)
        print_table(
            f"{OVERLAP_LAYERS} layers: matmuls and decode attention, serial vs two streams",
            results["overlap"],
        )
        results["green_contexts"] = green_context_table(device)
        print_table(f"{OVERLAP_LAYERS} layers, SMs partitioned (green contexts)", results["green_contexts"])
    if "steps" in args.parts:
        results["steps"] = step_breakdown(
            device, args.model_dir, args.quantization, args.kv_cache_dtype, args.model
        )
        flags = f" (--quantization {args.quantization or 'none'} --kv-cache-dtype {args.kv_cache_dtype})"
        which = args.model.name if args.model else "the 32-layer model"
        title = f"eager steps of {which}{flags}: kernel ms per step, by kind"
        print_table(title, results["steps"])
    if args.result_file:
        args.result_file.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
