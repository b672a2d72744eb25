"""FP8 kernel benchmark, side by side with bf16 in one run (on a GPU).

    python -m benchmarks.fp8 [--result-file bench-results/fp8.json]

1. Linear layers of Llama-3.1-8B (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down
   4096x14336) at M = 64, 256, 2048, 8192 rows: bf16 `F.linear` against `torch._scaled_mm` with
   row-wise scales, alone and with the activation quantization (separate torch ops, or the
   single-pass Triton kernel), and `_scaled_mm` with fast accumulation (`use_fast_accum`). TFLOP/s
   count 2*M*N*K; the error is the relative Frobenius norm of the FP8 output minus the bf16 output
   (random normal activations, weights ~ N(0, 0.02)).
2. The fused quantizing kernels against what they replace: RMSNorm (with residual) + quantize
   vs the bf16 RMSNorm kernel followed by torch-op quantization or the Triton quantize, at
   hidden 4096; SiLU-and-mul + quantize at intermediate 14336.
3. K1 decode shapes with an FP8 KV cache against the bf16 cache (same tables): time and KV bytes
   read per second (bf16 reads 2 bytes per element, FP8 one), FP8 on the shipped CUDA decode
   kernel (`kernels.cuda_decode`) and on the Triton decode kernel.

Tuning parts, not in the default run (`--parts sweep,sweep-prefill,floor`): the Triton decode kernel
over an FP8 cache per widening mode (`attention_jit.WIDEN_*`) and launch config, and the varlen kernel per
widening mode, each against bf16 in the same run; `floor`: what reading the paged K/V alone costs
(`gather_words_kernel`) for bf16 and FP8 bytes, in the cache's layout and a head-major one, and with
the FP8 bytes widened as the decode kernel widens them, next to both decode kernels.

Times are medians of `triton.testing.do_bench` (L2 flushed before each repetition): eager calls,
but part 3 replays each launch from a CUDA graph (as decode steps run), so that the host's launch
cost does not count.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from benchmarks.kernels import whole_tile_splits
from pagedserve.kernels import fp8, layers, triton_fp8
from pagedserve.kernels import triton_attention as ta

LINEAR_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (64, 256, 2048, 8192)
K1_SHAPES = [(1, 4096), (8, 4096), (64, 1024), (64, 4096), (256, 1024), (32, 16384)]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _spin_up(seconds: float = 0.5) -> None:
    """Keeps the GPU busy for a while so clocks are up before small kernels are timed (a sweep that
    compiled between measurements timed the same launch at 29 and 102 us)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = torch.cuda.Event(enable_timing=True)
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


def torch_quant(x: torch.Tensor) -> fp8.QuantizedActivation:
    """Per-token quantization as separate torch ops (what the fused kernels replace)."""
    return fp8.quantize_per_token_reference(x)


def bench_linear() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in LINEAR_SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        wq, ws = fp8.quantize_weight(w)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            xq = triton_fp8.quantize_per_token(x)
            ref = F.linear(x, w)
            out = fp8.fp8_linear(xq, wq, ws, None, torch.bfloat16, False)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            flop = 2 * m * n * k
            t_bf16 = _ms(lambda x=x, w=w: F.linear(x, w))
            t_mm = _ms(lambda xq=xq, wq=wq, ws=ws: fp8.fp8_linear(xq, wq, ws, None, torch.bfloat16, False))
            fast = fp8.fp8_linear(xq, wq, ws, None, torch.bfloat16, True)
            fast_err = ((fast.float() - ref.float()).norm() / ref.float().norm()).item()
            t_fast = _ms(lambda xq=xq, wq=wq, ws=ws: fp8.fp8_linear(xq, wq, ws, None, torch.bfloat16, True))
            t_triton_q = _ms(
                lambda x=x, wq=wq, ws=ws: fp8.fp8_linear(
                    triton_fp8.quantize_per_token(x), wq, ws, None, torch.bfloat16
                )
            )
            t_torch_q = _ms(
                lambda x=x, wq=wq, ws=ws: fp8.fp8_linear(torch_quant(x), wq, ws, None, torch.bfloat16)
            )
            row = dict(
                layer=name, m=m, n=n, k=k, bf16_us=t_bf16 * 1e3, fp8_mm_us=t_mm * 1e3,
                fp8_triton_quant_us=t_triton_q * 1e3, fp8_torch_quant_us=t_torch_q * 1e3,
                bf16_tflops=flop / t_bf16 / 1e9, fp8_tflops=flop / t_mm / 1e9,
                speedup_mm=t_bf16 / t_mm, speedup_with_quant=t_bf16 / t_triton_q,
                speedup_torch_quant=t_bf16 / t_torch_q, rel_fro_error=err,
                fp8_fast_accum_us=t_fast * 1e3, speedup_fast_accum=t_bf16 / t_fast,
                fast_accum_rel_fro_error=fast_err,
            )  # fmt: skip
            rows.append(row)
            print(
                f"linear {name:8s} M={m:5d}: bf16 {row['bf16_tflops']:6.0f} TFLOP/s, fp8 mm "
                f"{row['fp8_tflops']:6.0f} ({row['speedup_mm']:.2f}x), "
                f"+triton quant {row['speedup_with_quant']:.2f}x, "
                f"+torch quant {row['speedup_torch_quant']:.2f}x; rel err {err:.4f}; "
                f"fast accum {row['speedup_fast_accum']:.2f}x, rel err {fast_err:.4f}",
                flush=True,
            )
    return rows


def _fused_cases(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, gu: torch.Tensor) -> dict:
    """What each fused kernel replaces, as callables over one set of inputs."""
    return {
        "norm_bf16": lambda: layers.rms_norm(x, w, 1e-5, res),
        "norm_quant_fused": lambda: fp8.rms_norm_quant(x, w, 1e-5, res),
        "norm_then_triton_quant": lambda: triton_fp8.quantize_per_token(layers.rms_norm(x, w, 1e-5, res)[0]),
        "norm_then_torch_quant": lambda: torch_quant(layers.rms_norm(x, w, 1e-5, res)[0]),
        "silu_bf16": lambda: layers.silu_and_mul(gu),
        "silu_quant_fused": lambda: fp8.silu_and_mul_quant(gu),
        "silu_then_triton_quant": lambda: triton_fp8.quantize_per_token(layers.silu_and_mul(gu)),
        "silu_then_torch_quant": lambda: torch_quant(layers.silu_and_mul(gu)),
    }


def linear_errors(device: str, rows: tuple[int, ...]) -> list[dict]:
    """Relative Frobenius error of the FP8 linear's output against bf16's, per layer and M, with
    activations like the layer's real inputs: unit-RMS normal rows (what RMSNorm hands qkv and
    gate_up, and roughly the attention output), and for down_proj SiLU(gate) * up of such a
    product. On the CPU the FP8 product is the float32 reference; the GPU's `_scaled_mm` differs
    from it only in accumulation order and the final bf16 rounding."""
    out = []
    gen = torch.Generator(device=device).manual_seed(3)
    for name, (n, k) in LINEAR_SHAPES.items():
        w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
        wq, ws = fp8.quantize_weight(w)
        for m in rows:
            if name == "down":
                w_gu = torch.randn(2 * k, 4096, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
                h = torch.randn(m, 4096, device=device, generator=gen, dtype=torch.bfloat16)
                x = layers.silu_and_mul(F.linear(h, w_gu))
            else:
                x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            ref = F.linear(x, w).float()
            got = fp8.fp8_linear(fp8.quantize_per_token(x), wq, ws, None, torch.bfloat16).float()
            err = ((got - ref).norm() / ref.norm()).item()
            out.append(dict(layer=name, m=m, n=n, k=k, rel_fro_error=err))
            print(f"error {name:8s} M={m:5d} ({n}x{k}): {err:.4f}", flush=True)
    return out


def bench_fused() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
        res = torch.randn_like(x)
        w = torch.randn(4096, device="cuda", generator=gen, dtype=torch.bfloat16)
        gu = torch.randn(m, 2 * 14336, device="cuda", generator=gen, dtype=torch.bfloat16)
        row = {"m": m} | {name: _ms(fn) * 1e3 for name, fn in _fused_cases(x, res, w, gu).items()}
        rows.append(row)
        print(
            f"fused M={m:5d}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items() if k != "m"), flush=True
        )
    return rows


def _decode_case(batch: int, context: int, kv_dtype: torch.dtype, gen: torch.Generator):
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 64
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    if kv_dtype != torch.bfloat16:
        k, v = _fp8_copy(k), _fp8_copy(v)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)[: batch * blocks_per_seq]
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    return q, k, v, tables, seq_lens, cu


@contextlib.contextmanager
def launch_setting(name: str, value: Any) -> Iterator[None]:
    """Runs the block with `triton_attention.<name>` (FP8_DECODE_WIDEN, FP8_PREFILL_WIDEN or
    FP8_DECODE_CUDA) set to `value`, then puts the shipped value back, also on an error."""
    shipped = getattr(ta, name)
    setattr(ta, name, value)
    try:
        yield
    finally:
        setattr(ta, name, shipped)


def _graph_of(fn) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph (after one eager call, which compiles and sizes scratch)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _graph_ms(fn) -> float:
    """`_ms` of `fn` replayed from a CUDA graph, as the executor runs decode steps: without the
    host's launch cost, which on some hosts exceeds a small decode's GPU time."""
    return _ms(_graph_of(fn).replay)


_EVICT_BYTES = 256 << 20  # as do_bench's flush buffer: five times the H200's 50 MB of L2


def _graph_ms_clean_l2(fn, reps: int = 100) -> float:
    """Like `_graph_ms`, but L2 is emptied before each replay by *reading* a 256 MB buffer.

    do_bench empties it by zeroing such a buffer, which leaves L2 full of dirty lines that the
    kernel under test must then write back to HBM: a fixed cost per launch, which weighs twice as
    much on an FP8 decode as on the bf16 decode it is compared with (half the time)."""
    graph = _graph_of(fn)
    evict = torch.ones(_EVICT_BYTES // 4, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(5):
        graph.replay()
    for start, end in zip(starts, ends, strict=True):
        evict.sum()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends, strict=True))


def bench_decode() -> list[dict]:
    """K1 decode shapes, each launch replayed from a CUDA graph: the bf16 cache, the FP8 cache with
    the shipped kernel (`fp8`: the CUDA kernel, `kernels.cuda_decode`) and with the Triton decode
    kernel (`fp8_triton`), all with the shape-based launch."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    scale = torch.full((1,), 0.02, device="cuda")
    _spin_up()
    for batch, context in K1_SHAPES:
        row: dict = {"batch": batch, "context": context}
        for label, dtype, cuda_config in (
            ("bf16", torch.bfloat16, None),
            ("fp8", torch.float8_e4m3fn, ta.FP8_DECODE_CUDA),
            ("fp8_triton", torch.float8_e4m3fn, None),
        ):
            q, k, v, tables, seq_lens, cu = _decode_case(batch, context, dtype, gen)
            kw = {} if dtype == torch.bfloat16 else dict(k_scale=scale, v_scale=scale)
            call = partial(ta.paged_attention, q, k, v, tables, seq_lens, cu, HEAD_DIM**-0.5, **kw)
            kv_bytes = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * k.element_size()
            with launch_setting("FP8_DECODE_CUDA", cuda_config):
                for suffix, timer in (("", _graph_ms), ("_clean_l2", _graph_ms_clean_l2)):
                    t = timer(call)
                    row[f"{label}{suffix}_us"] = t * 1e3
                    row[f"{label}{suffix}_gbps"] = kv_bytes / t / 1e6
            del q, k, v, call
        for suffix in ("", "_clean_l2"):
            for label in ("fp8", "fp8_triton"):
                row[f"{label}{suffix}_bw_ratio"] = row[f"{label}{suffix}_gbps"] / row[f"bf16{suffix}_gbps"]
        rows.append(row)
        for suffix, how in (("", "L2 zeroed (do_bench)"), ("_clean_l2", "L2 emptied by reading")):
            print(
                f"decode ({batch}, {context}), {how}: bf16 {row[f'bf16{suffix}_us']:.1f} us "
                f"{row[f'bf16{suffix}_gbps']:.0f} GB/s; fp8 {row[f'fp8{suffix}_us']:.1f} us "
                f"(bw ratio {row[f'fp8{suffix}_bw_ratio']:.2f}); fp8 on the Triton kernel "
                f"{row[f'fp8_triton{suffix}_us']:.1f} us "
                f"(bw ratio {row[f'fp8_triton{suffix}_bw_ratio']:.2f})",
                flush=True,
            )
    return rows


# (block_n, num_warps, num_stages). A first sweep on the H200 also tried (64, 4, 3), (64, 4, 1),
# (128, 4, 1) and single tiles of 256 keys: never the fastest at any K1 shape.
SWEEP_LOOP_CONFIGS = [(64, 4, 2), (128, 4, 2), (128, 8, 2), (64, 2, 2), (32, 4, 2)]
SWEEP_SINGLE_CONFIGS = [(128, 8, 2)]
PREFILL_SHAPES = [(4, 2048, 2048), (8, 512, 8192)]  # (sequences, new tokens each, context)


def _attention(q, k, v, args: tuple, **kw) -> torch.Tensor:
    return ta.paged_attention(q, k, v, *args, HEAD_DIM**-0.5, **kw)


def _fp8_copy(x: torch.Tensor) -> torch.Tensor:
    """x / 0.02 in e4m3, saturated (the cache holds at most +-448)."""
    return (x / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)


def _sweep_case(batch: int, context: int, gen: torch.Generator) -> tuple:
    """A K1 decode case for the sweeps: q, the bf16 caches, their FP8 copies, the launch's other
    arguments, the bf16 kernel's result over the dequantized FP8 caches (what FP8 variants are
    compared with) and the bytes an FP8 decode reads."""
    q, k, v, tables, seq_lens, cu = _decode_case(batch, context, torch.bfloat16, gen)
    args = (tables, seq_lens, cu)
    k8, v8 = _fp8_copy(k), _fp8_copy(v)
    want = _attention(q, k8.to(torch.bfloat16) * 0.02, v8.to(torch.bfloat16) * 0.02, args)
    return q, k, v, k8, v8, args, want, batch * context * 2 * NUM_KV_HEADS * HEAD_DIM


def sweep_decode(modes: tuple[int, ...]) -> list[dict]:
    """K1 decode shapes over an FP8 cache: each widening mode (`attention_jit.WIDEN_*`) with the
    shape-based launch and with every config of SWEEP_*_CONFIGS, against bf16's shape-based launch.
    `max_err`: against the bf16 kernel over the dequantized caches."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    scale = torch.full((1,), 0.02, device="cuda")
    _spin_up()
    for batch, context in K1_SHAPES:
        q, k, v, k8, v8, args, want, fp8_bytes = _sweep_case(batch, context, gen)
        t = _ms(partial(_attention, q, k, v, args))
        row = {"batch": batch, "context": context, "bf16_us": t * 1e3, "bf16_gbps": 2 * fp8_bytes / t / 1e6}
        variants = [("auto", None, None)]
        variants += [(f"loop{c}", ta.DecodeConfig(*c), None) for c in SWEEP_LOOP_CONFIGS]
        variants += [
            (f"single{c}", ta.DecodeConfig(*c), -(-context // c[0]))
            for c in SWEEP_SINGLE_CONFIGS
            if -(-context // c[0]) <= 128
        ]
        for mode, (label, config, splits) in itertools.product(modes, variants):
            kw = dict(k_scale=scale, v_scale=scale, decode_config=config, num_splits=splits)
            with launch_setting("FP8_DECODE_WIDEN", mode):
                err = (_attention(q, k8, v8, args, **kw).float() - want.float()).abs().max().item()
                t = _ms(partial(_attention, q, k8, v8, args, **kw))
            ratio = fp8_bytes / t / 1e6 / row["bf16_gbps"]
            row[f"m{mode}_{label}_us"] = t * 1e3
            row[f"m{mode}_{label}_ratio"] = ratio
            print(
                f"decode ({batch}, {context}) bf16 {row['bf16_us']:.1f} us | mode {mode} {label}: "
                f"{t * 1e3:.1f} us, bw ratio {ratio:.2f}, max err {err:.3g}",
                flush=True,
            )
        rows.append(row)
        del q, k, v, k8, v8
    return rows


def sweep_prefill(modes: tuple[int, ...]) -> list[dict]:
    """The varlen kernel over an FP8 cache against bf16, per widening mode: fresh prompts, and
    chunks after a long context (PREFILL_SHAPES)."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(5)
    scale = torch.full((1,), 0.02, device="cuda")
    for num_seqs, q_len, context in PREFILL_SHAPES:
        blocks_per_seq = context // BLOCK_SIZE
        num_blocks = num_seqs * blocks_per_seq + 8
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        k8, v8 = _fp8_copy(k), _fp8_copy(v)
        tables = torch.randperm(num_blocks, device="cuda", generator=gen)[: num_seqs * blocks_per_seq]
        tables = tables.view(num_seqs, blocks_per_seq).to(torch.int32)
        q = torch.randn(
            num_seqs * q_len, NUM_Q_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16
        )
        seq_lens = torch.full((num_seqs,), context, device="cuda", dtype=torch.int32)
        args = (tables, seq_lens, torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32) * q_len)
        row = {"num_seqs": num_seqs, "q_len": q_len, "context": context}
        row["bf16_us"] = _ms(partial(_attention, q, k, v, args)) * 1e3
        want = _attention(q, k8.to(torch.bfloat16) * 0.02, v8.to(torch.bfloat16) * 0.02, args)
        for mode in modes:
            with launch_setting("FP8_PREFILL_WIDEN", mode):
                got = _attention(q, k8, v8, args, k_scale=scale, v_scale=scale)
                t = _ms(partial(_attention, q, k8, v8, args, k_scale=scale, v_scale=scale)) * 1e3
            err = (got.float() - want.float()).abs().max().item()
            row[f"m{mode}_us"] = t
            print(
                f"prefill {num_seqs}x{q_len} (context {context}): bf16 {row['bf16_us']:.1f} us | "
                f"mode {mode}: {t:.1f} us ({row['bf16_us'] / t:.2f}x of bf16's speed), max err {err:.3g}",
                flush=True,
            )
        rows.append(row)
    return rows


@triton.jit
def gather_words_kernel(
    k_ptr, v_ptr, block_tables_ptr, out_ptr, keys_per_program, stride_kb, stride_kt, stride_kh, stride_bt,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, WORDS: tl.constexpr, WIDEN: tl.constexpr,
):  # fmt: skip
    """Reads one (sequence, KV head, split)'s keys and values through its block table, as int32
    words (WORDS per key and head), and stores their xor: the memory traffic of a decode call with
    no arithmetic at all, whatever the element type (`bench.kernels.gather_only_kernel` converts
    each element to float32, which for FP8 is the cost being measured). WIDEN: the words hold e4m3
    bytes, and each is widened to float16 (`cvt.rn.f16x2.e4m3x2`, as the decode kernel does) and
    summed instead. Strides are in words."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    words = tl.arange(0, WORDS)
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
    total = tl.zeros([BLOCK_N, WORDS * 4], dtype=tl.float32)
    first = split * keys_per_program
    for k0 in range(first, first + keys_per_program, BLOCK_N):
        kpos = k0 + tl.arange(0, BLOCK_N)
        block_ids = tl.load(block_tables_ptr + seq * stride_bt + kpos // PAGE_SIZE).to(tl.int64)
        rows = block_ids * stride_kb + (kpos % PAGE_SIZE) * stride_kt + kv_head * stride_kh
        if WIDEN:
            byte = tl.arange(0, WORDS * 4)
            k = tl.load(k_ptr.to(tl.pointer_type(tl.float8e4nv)) + rows[:, None] * 4 + byte[None, :])
            v = tl.load(v_ptr.to(tl.pointer_type(tl.float8e4nv)) + rows[:, None] * 4 + byte[None, :])
            total += k.to(tl.float16).to(tl.float32) + v.to(tl.float16).to(tl.float32)
        else:
            acc ^= tl.load(k_ptr + rows[:, None] + words[None, :])
            acc ^= tl.load(v_ptr + rows[:, None] + words[None, :])
    program = (seq * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split
    tl.store(out_ptr + program, tl.xor_sum(tl.xor_sum(acc, 1), 0) + tl.sum(tl.sum(total, 1), 0).to(tl.int32))


# label -> (bytes per element, layout, keys per tile, programs per SM, widen). NHD is the pool's
# [blocks, block_size, kv_heads, head_dim]; HND [blocks, kv_heads, block_size, head_dim] keeps each
# head's block contiguous (2 KB in FP8 instead of 16 rows of 128 bytes).
FLOOR_VARIANTS = {
    "bf16": (2, "NHD", 64, 4, False),
    "fp8": (1, "NHD", 64, 4, False),
    "fp8 8 programs/SM": (1, "NHD", 64, 8, False),
    "fp8 128-key tiles": (1, "NHD", 128, 4, False),
    "fp8 widened": (1, "NHD", 64, 4, True),
    "bf16 HND": (2, "HND", 64, 4, False),
    "fp8 HND": (1, "HND", 64, 4, False),
    "fp8 HND 128-key tiles": (1, "HND", 128, 4, False),
}


def _gather_floor_us(batch: int, context: int, variant: tuple) -> float:
    element_bytes, layout, block_n, programs_per_sm, widen = variant
    num_blocks = batch * context // BLOCK_SIZE + 64
    words = HEAD_DIM * element_bytes // 4
    nhd = layout == "NHD"
    shape = (num_blocks, *((BLOCK_SIZE, NUM_KV_HEADS) if nhd else (NUM_KV_HEADS, BLOCK_SIZE)), words)
    # random words whose bytes are finite e4m3 values (0x3c masks off NaN patterns), for WIDEN
    k = torch.randint(0, 2**30, shape, dtype=torch.int32, device="cuda") & 0x3C3C3C3C
    v = torch.randint(0, 2**30, shape, dtype=torch.int32, device="cuda") & 0x3C3C3C3C
    stride_kt, stride_kh = (k.stride(1), k.stride(2)) if nhd else (k.stride(2), k.stride(1))
    tables = torch.randperm(num_blocks, device="cuda")[: batch * context // BLOCK_SIZE]
    tables = tables.view(batch, -1).to(torch.int32)
    splits = whole_tile_splits(batch, context, block_n, programs_per_sm, ta._sm_count(k.device))
    grid = (batch, NUM_KV_HEADS, splits)
    out = torch.empty(batch * NUM_KV_HEADS * splits, dtype=torch.int32, device="cuda")
    return 1e3 * _ms(lambda: gather_words_kernel[grid](
        k, v, tables, out, context // splits, k.stride(0), stride_kt, stride_kh, tables.stride(0),
        BLOCK_N=block_n, PAGE_SIZE=BLOCK_SIZE, WORDS=words, WIDEN=widen, num_warps=4,
    ))  # fmt: skip


def bench_floor() -> list[dict]:
    """K1 decode shapes (one tile or more per program): both decode kernels (shape-based launch)
    and the gather floors of FLOOR_VARIANTS, each with GB/s of the K/V bytes it reads."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    scale = torch.full((1,), 0.02, device="cuda")
    _spin_up()
    for batch, context in K1_SHAPES[1:]:
        elements = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM
        row: dict = {"batch": batch, "context": context}
        for label, dtype in (("kernel bf16", torch.bfloat16), ("kernel fp8", torch.float8_e4m3fn)):
            q, k, v, tables, seq_lens, cu = _decode_case(batch, context, dtype, gen)
            kw = {} if dtype == torch.bfloat16 else dict(k_scale=scale, v_scale=scale)
            row[label] = 1e3 * _ms(partial(_attention, q, k, v, (tables, seq_lens, cu), **kw))
            row[f"{label} GB/s"] = elements * k.element_size() / row[label] / 1e3
            del q, k, v
        for label, variant in FLOOR_VARIANTS.items():
            row[label] = _gather_floor_us(batch, context, variant)
            row[f"{label} GB/s"] = elements * variant[0] / row[label] / 1e3
        rows.append(row)
        print(" | ".join(f"{key} {value:.0f}" if isinstance(value, float) else f"{key} {value}"
                         for key, value in row.items()), flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--result-file", default=None)
    parser.add_argument(
        "--parts",
        default="linear,fused,decode",
        help="any of linear,fused,decode,errors,sweep,sweep-prefill,floor",
    )
    parser.add_argument("--error-rows", default="64,256,2048,8192", help="M values of the errors part")
    parser.add_argument(
        "--sweep-modes", default="1,2", help="widening modes the sweeps try (attention_jit.WIDEN_*)"
    )
    parser.add_argument("--device", default="cuda", help="errors part only: cpu runs the references")
    args = parser.parse_args(argv)
    result = {}
    parts = args.parts.split(",")
    if "errors" in parts:
        rows = tuple(int(r) for r in args.error_rows.split(","))
        result["errors"] = linear_errors(args.device, rows)
    if args.device == "cuda":
        print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if "linear" in parts:
        result["linear"] = bench_linear()
    if "fused" in parts:
        result["fused"] = bench_fused()
    if "decode" in parts:
        result["decode"] = bench_decode()
    modes = tuple(int(m) for m in args.sweep_modes.split(","))
    if "sweep" in parts:
        result["sweep_decode"] = sweep_decode(modes)
    if "sweep-prefill" in parts:
        result["sweep_prefill"] = sweep_prefill(modes)
    if "floor" in parts:
        result["floor"] = bench_floor()
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
