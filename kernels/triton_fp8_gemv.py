"""FP8 weight-only matmul for small M: y = x @ (W * scale[:, None])^T (+ b), W in e4m3.

Why: a decode step at a few tokens reads every weight once, so its time is the weight bytes over
the memory bandwidth. `kernels.fp8.fp8_linear` (`torch._scaled_mm`, row-wise scales) is built for
large M and needs per-token FP8 activations, which cost a quantizing pass before every projection;
at M = 1 the FP8 path measured slower than bf16 on the H200 although it reads half the bytes
(issue 33). Here the activations stay in the model dtype (no quantization at all) and the e4m3
weights are widened to that dtype in registers, the way vLLM's Marlin-FP8 and TensorRT-LLM's
weight-only GEMMs do; the per-output-channel scale is applied once per output, in the epilogue.

Storage is `executor.quantization.Fp8Linear`'s own: weight [N, K] float8_e4m3fn (rows contiguous),
weight_scale [N] float32. No second format, no repacking.

Tiling (memory bound): programs tile N (`BLOCK_N` rows of W each, its bytes read once per M tile)
and, when N alone gives too few programs to keep every SM's loads in flight, split K
(`split_k` programs per N tile, each writing float32 partial sums to a workspace that
`_split_k_reduce_kernel` sums, scales and casts: deterministic, unlike atomics). Two inner products:

* `USE_DOT=False` (M of a few rows): the [BLOCK_M, BLOCK_N, BLOCK_K] products are summed over K
  in float32 on the CUDA cores: no padding of M to the tensor cores' 16 rows;
* `USE_DOT=True`: `tl.dot` of the [BLOCK_M, BLOCK_K] activations with the widened [BLOCK_K,
  BLOCK_N] weights (tensor cores; M padded to 16 by masking), float32 accumulation.

The configuration is a fixed table keyed by M (`config_for`), and the grid depends on shapes and
the device's SM count only: nothing is autotuned, so a launch inside a CUDA graph capture is the
same launch as the warm-up's (which compiled it). Offsets are 64-bit. The table's entries are
first guesses for the H200; `benchmarks/small_m.py --sweep` measures the alternatives.

GEMV for M <= `GEMV_MAX_M` (`gemv`, `_gemv_kernel`; issue 33). At one to four rows the tiled kernel
above reached only 0.35-0.73 of the H200's copy bandwidth: a 16-row tensor-core tile does 16x the
work, and too few weight bytes were in flight per SM. The GEMV kernel gives each program
`BLOCK_N` output columns and a slice of K (`SPLIT_K` slices, partial sums reduced by
`_split_k_reduce_kernel` in a fixed order: deterministic); each thread loads 16 contiguous bytes
of a weight row at a time (the layout Triton picks for contiguous rows: FP8 16 elements, bf16 8),
widens them to float32 and multiplies-and-adds them with each of the M activation rows on the
CUDA cores (M is a compile-time constant, each row its own accumulator; no tl.dot, no padding
of M). The K loop is `tl.range(..., num_stages)`: with more than one stage Triton prefetches the
weight tiles of the next steps into shared memory with cp.async (loads that feed no tl.dot are
pipelined only when the loop asks), which keeps `(num_stages - 1) * BLOCK_N * BLOCK_K` bytes in
flight per program on top of the occupancy. `acc_2d` keeps a [BLOCK_N, BLOCK_K] float32
accumulator per row and reduces it across threads once, after the loop (registers instead of a
warp shuffle per step); without it each step is reduced to [BLOCK_N] (fewer registers). The same
body serves 16-bit weights (no scale): `linear_16bit`, which `executor.quantization` dispatches
to at M <= its bf16 threshold (one row by default) instead of cuBLAS. Configurations: `GEMV_TABLE`
(measured shapes, pasted from `benchmarks/small_m.py --sweep`) and `GEMV_DEFAULTS` (by weight
width and M) for any other shape.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8 import FP8_DTYPE
from pagedserve.kernels.pdl import begin as pdl_begin
from pagedserve.kernels.pdl import pdl_enabled
from pagedserve.kernels.triton_layers import silu_and_mul_values

__all__ = [
    "FP8_GEMV_MAX_M",
    "GEMV_MAX_M",
    "GemvConfig",
    "GemvNorm",
    "SplitKGemvConfig",
    "config_for",
    "fuses_norm",
    "fuses_silu_and_mul",
    "gemv",
    "gemv_config_for",
    "linear_16bit",
    "weight_only_linear",
]

# Read once: @triton.jit chose the interpreter or the compiler at import time as well.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Without a CUDA device (the interpreter), the grid is planned for an H200's 132 SMs.
_DEFAULT_SMS = 132
# Programs to aim for: several per SM, so that each SM keeps enough weight loads in flight to
# cover the memory latency (a GEMV needs ~40-64 KB in flight per SM on Hopper).
_PROGRAMS_PER_SM = 4
# A split never gets fewer than this many BLOCK_K steps: each split's partial sums cost a
# workspace write and read, and a loop of one or two steps cannot pipeline its loads.
_MIN_K_STEPS_PER_SPLIT = 4
_MAX_SPLIT_K = 16


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of the weight-only kernel.

    Attributes:
        block_m: activation rows per program (>= 16 with `use_dot`: the tensor cores' minimum).
        block_n: weight rows (outputs) per program.
        block_k: reduction elements per loop step (contiguous bytes of each weight row).
        use_dot: tensor-core `tl.dot` instead of a float32 multiply-and-sum.
        num_warps, num_stages: Triton's (the loop's software-pipelined loads).
        split_k: programs per output tile along K; None = chosen from the grid (`_split_k`).
    """

    block_m: int
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 4
    split_k: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.use_dot and min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError("use_dot needs block_m, block_n and block_k >= 16")
        if self.split_k is not None and self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


# M -> configuration (the first entry whose bound is >= M), from `benchmarks/small_m.py --sweep`
# on the H200 (benchmarks/results/2026-12-03-h200): up to 16 rows one tensor-core tile of 16 x 64
# x 256 is within 3% of each llama-8b shape's best (qkv, o, gate_up, down, LM head) and its time
# does not depend on M, while the CUDA-core multiply-and-sum of a few rows (use_dot=False, still
# a valid configuration) ran 1.3-13x slower from M = 2 on.
CONFIG_TABLE: tuple[tuple[int, GemvConfig], ...] = (
    (16, GemvConfig(block_m=16, block_n=64, block_k=256, use_dot=True, num_warps=4, num_stages=4)),
    (32, GemvConfig(block_m=32, block_n=64, block_k=128, use_dot=True, num_warps=4, num_stages=4)),
    (64, GemvConfig(block_m=64, block_n=64, block_k=128, use_dot=True, num_warps=4, num_stages=3)),
)


def config_for(m: int) -> GemvConfig:
    """The table's configuration for M rows (beyond the table, its last entry tiles M)."""
    for bound, config in CONFIG_TABLE:
        if m <= bound:
            return config
    return CONFIG_TABLE[-1][1]


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether `tl.dot` gets float32 operands: for float32 activations (IEEE products), and for
    every dtype under the interpreter, whose `tl.dot` multiplies bf16's raw uint16 bits (triton
    3.7.1; see `triton_attention._dot_in_fp32`). Compiled kernels keep bf16/fp16 operands."""
    return dtype == torch.float32 or _INTERPRETED


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(fixed: int | None, tiles: int, steps: int, programs_per_sm: int, device: torch.device) -> int:
    """How many programs share each of `tiles` output tiles' `steps` K steps: `fixed` (at most one
    per step) if set, else enough for `programs_per_sm` programs per SM, each with at least
    `_MIN_K_STEPS_PER_SPLIT` steps, at most `_MAX_SPLIT_K` (shapes only: graph-safe)."""
    if fixed is not None:
        return max(1, min(fixed, steps))
    wanted = triton.cdiv(programs_per_sm * _num_sms(device), tiles)
    return max(1, min(wanted, steps // _MIN_K_STEPS_PER_SPLIT, _MAX_SPLIT_K))


def _split_k(config: GemvConfig, m: int, n: int, k: int, device: torch.device) -> int:
    """The tiled kernel's K split (`_splits`, `_PROGRAMS_PER_SM` programs per SM)."""
    tiles = triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m)
    return _splits(config.split_k, tiles, triton.cdiv(k, config.block_k), _PROGRAMS_PER_SM, device)


@triton.jit
def _weight_only_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Program (n tile, k split, m tile): the [BLOCK_M, BLOCK_N] partial product over its K range;
    without a split, scaled (+ bias) and stored in the output's dtype, else stored in float32 to
    partial[split, M, N]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    k_begin = pid_k.to(tl.int64) * k_per_split
    x_rows = x_ptr + rm[:, None] * stride_xm
    w_rows = w_ptr + rn[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        rk = k_begin + k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        # e4m3 -> the activation dtype is exact (3 mantissa bits, a narrower exponent range)
        w = w.to(x.dtype)
        if USE_DOT and DOT_F32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        elif USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if SPLIT:
        offs = pid_k.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
        tl.store(partial_ptr + offs, acc, mask=m_mask[:, None] & n_mask[None, :])
    else:
        scale = tl.load(scale_ptr + rn, mask=n_mask, other=0.0)
        y = acc * scale[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm[:, None] * stride_om + rn[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    """out[m, n] = sum over splits of partial[s, m, n], times scale[n] (+ bias[n]), in a fixed order."""
    m = tl.program_id(1).to(tl.int64)
    rn = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + (s * M + m) * N + rn, mask=mask, other=0.0)
    y = acc
    if HAS_SCALE:
        y = acc * tl.load(scale_ptr + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=mask)


def weight_only_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: GemvConfig | SplitKGemvConfig | None = None,
) -> torch.Tensor:
    """See `kernels.fp8.weight_only_linear`: the GEMV kernel (`gemv`) for M <= FP8_GEMV_MAX_M,
    the tiled kernel above; `config` overrides the tables' (benchmarks, tests), its type choosing the
    kernel."""
    if isinstance(config, SplitKGemvConfig) or (config is None and x.shape[0] <= FP8_GEMV_MAX_M):
        assert weight.dtype == FP8_DTYPE, "weight: e4m3 (16-bit weights: linear_16bit)"
        return gemv(x, weight, weight_scale, bias, out_dtype, config)
    assert x.dim() == 2 and weight.dim() == 2, "x [M, K], weight [N, K]"
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x has K={k}, weight {tuple(weight.shape)}"
    assert weight.dtype == FP8_DTYPE and weight.stride(1) == 1, "weight: e4m3 rows, contiguous"
    assert x.stride(1) == 1 or k <= 1, "x rows must be contiguous"
    assert weight_scale.numel() == n and weight_scale.dtype == torch.float32
    assert weight_scale.is_contiguous()
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        return out if bias is None else out.add_(bias)
    config = config or config_for(m)
    assert isinstance(config, GemvConfig)
    split_k, k_per_split = _k_ranges(k, _split_k(config, m, n, k, x.device), config.block_k)
    partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    grid = (triton.cdiv(n, config.block_n), split_k, triton.cdiv(m, config.block_m))
    _weight_only_kernel[grid](
        x, weight, weight_scale, weight_scale if bias is None else bias, out, partial,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_DOT=config.use_dot,
        DOT_F32=_dot_in_fp32(x.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split_k > 1:
        _sum_splits(partial, weight_scale, bias, out)
    return out


def _k_ranges(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(splits, K per split) for `split_k` splits of K in whole block_k steps: rounding each
    split up may leave fewer of them."""
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def _sum_splits(
    partial: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    """out = (the float32 partial sums [splits, M, N] summed in order) * scale (+ bias)."""
    split_k, m, n = partial.shape
    block = min(1024, triton.next_power_of_2(n))
    placeholder = partial if scale is None else scale  # a pointer for the arguments left unread
    _split_k_reduce_kernel[(triton.cdiv(n, block), m)](
        partial, placeholder, placeholder if bias is None else bias, out, m, n, out.stride(0),
        SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block, HAS_SCALE=scale is not None, num_warps=4,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------- #
# GEMV for M <= GEMV_MAX_M: CUDA-core multiply-and-add, 16-byte weight loads, split-K
# --------------------------------------------------------------------------------------------- #

# The most activation rows the GEMV kernel takes (each row is an accumulator of its own).
GEMV_MAX_M = 4
# The most rows `weight_only_linear` gives the GEMV kernel, the tiled kernel taking more. Measured
# on the H200 (benchmarks/results/2026-12-04-h200-gemv), FP8 at M = 1 / 2 / 4 as fractions of the
# copy bandwidth, GEMV against tiled: qkv 0.68 / 0.55 / 0.35 against 0.40, o 0.59 / 0.49 / 0.33
# against 0.33, gate_up 0.85 / 0.72 / 0.45 against 0.56-0.60, down 0.84 / 0.69 / 0.46 against
# 0.48-0.52, LM head 1.03 / 0.82 / 0.48 against 0.64-0.69.
FP8_GEMV_MAX_M = 2
# PAGEDSERVE_GEMV_PREFETCH=1 (with PDL, `kernels.pdl`): the GEMV asks L2 for its weights before it
# waits for the previous kernel, so that the weight stream starts during that kernel's tail. Off by
# default until measured: the one-wave grid asks for its whole weight at once, and a weight larger
# than L2 (gate_up, down, the LM head: 117 MB to 1 GB against 50 MB) may then be read twice. The
# first GPU run with it (an H100, bf16 at one request) was 1.41x of the read floor against 1.25x at
# 8 requests, which do not use the GEMV. PAGEDSERVE_GEMV_PREFETCH=head asks for the first
# `_PREFETCH_HEAD_BYTES` of each weight row only (a few MB a projection, well inside L2): the
# loop's first loads, whose latency a kernel that starts cold waits out, then hit L2.
_PREFETCH = os.environ.get("PAGEDSERVE_GEMV_PREFETCH", "0")
_PREFETCH_HEAD_BYTES = 2048
# With split_k=None, splits are added while the grid has fewer than this many programs per SM
# (each one already keeps (num_stages - 1) tiles in flight; a split costs a second launch).
_GEMV_PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class SplitKGemvConfig:
    """One launch configuration of the GEMV kernel (`gemv`).

    Attributes:
        block_n: outputs (weight rows) per program.
        block_k: reduction elements per loop step; 16-byte loads need block_k * element size >= 16
            per thread (FP8: 16 elements, bf16: 8), and one warp reduces block_k * size / 16 lanes.
        split_k: programs along K per block of outputs (1: one launch, no workspace); None: chosen
            from the grid (`_gemv_split_k`).
        num_warps: Triton's.
        num_stages: the K loop's pipeline depth (`tl.range`): 1 loads in registers only, more
            prefetch that many - 1 tiles into shared memory.
        acc_2d: accumulate [block_n, block_k] per row and reduce once after the loop, instead of a
            [block_n] accumulator reduced at every step.
    """

    block_n: int
    block_k: int
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 4
    acc_2d: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.split_k is not None and self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")

    def describe(self) -> str:
        """One table cell: n, k, split, warps, stages, accumulator."""
        split = "auto" if self.split_k is None else self.split_k
        acc = "2d" if self.acc_2d else "1d"
        return (
            f"gemv n{self.block_n} k{self.block_k} split {split} w{self.num_warps} s{self.num_stages} {acc}"
        )


def _kind(weight_dtype: torch.dtype) -> str:
    """The tables' key for a weight dtype: "fp8" (one byte) or "16bit" (bf16, fp16)."""
    return "fp8" if weight_dtype.itemsize == 1 else "16bit"


def _bucket(m: int) -> int:
    """The tables' M: 1, 2 or 4 (3 rows take 4's configuration)."""
    return 1 if m <= 1 else (2 if m == 2 else 4)


# (weight kind, M bucket) -> configuration, for any shape the sweep has not measured. Reasoning
# for the H200 (132 SMs, ~4.8 TB/s HBM: ~18 bytes per SM-cycle, and ~30-40 KB in flight per SM to
# cover the latency): a step of 8 x 512 FP8 bytes (8 x 256 bf16) is two 16-byte loads per thread
# of 4 warps, one warp across each 512-byte row piece; 4 stages put 3 such 4 KB tiles in flight
# per program ahead of the one being multiplied, and the llama-8b shapes give 512 (o, down) to
# 16,032 (LM head) programs of 8 rows, 4+ per SM, without a split (split auto only adds one below
# 2 programs per SM: small tensor-parallel shards). Measured (benchmarks/results/2026-12-04-h200-gemv):
# within 1-3% of the sweep's best at M = 1 on every shape; the 2-D accumulators beat the 1-D ones
# at 4 rows too, where the multiply-adds (4 per weight byte, plus the widening) make the kernel
# compute-bound on the CUDA cores: FP8 at 3-4 rows stays on the tiled kernel (FP8_GEMV_MAX_M).
GEMV_DEFAULTS: dict[tuple[str, int], SplitKGemvConfig] = {
    ("fp8", 1): SplitKGemvConfig(block_n=8, block_k=512, split_k=None, num_warps=4, num_stages=4),
    ("fp8", 2): SplitKGemvConfig(block_n=8, block_k=512, split_k=None, num_warps=4, num_stages=4),
    ("fp8", 4): SplitKGemvConfig(
        block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4, acc_2d=False
    ),
    ("16bit", 1): SplitKGemvConfig(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),
    ("16bit", 2): SplitKGemvConfig(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),
    ("16bit", 4): SplitKGemvConfig(
        block_n=8, block_k=128, split_k=None, num_warps=4, num_stages=4, acc_2d=False
    ),
}

# (weight kind, M bucket, N, K) -> configuration measured best on that shape: the lines that
# `python -m benchmarks.small_m --sweep` prints under "GEMV_TABLE entries" (H200, llama-8b shapes,
# benchmarks/results/2026-12-04-h200-gemv; the fraction of the copy bandwidth each reached). FP8
# at 4 rows is left out: the tiled kernel serves it (FP8_GEMV_MAX_M).
_C = SplitKGemvConfig
GEMV_TABLE: dict[tuple[str, int, int, int], SplitKGemvConfig] = {
    ("fp8", 1, 6144, 4096): _C(block_n=16, block_k=512, split_k=None, num_warps=4, num_stages=4),  # qkv 0.68
    ("fp8", 2, 6144, 4096): _C(block_n=16, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.55
    ("fp8", 1, 4096, 4096): _C(block_n=8, block_k=512, split_k=None, num_warps=4, num_stages=4),  # o 0.59
    ("fp8", 2, 4096, 4096): _C(block_n=8, block_k=512, split_k=None, num_warps=4, num_stages=4),  # 0.49
    ("fp8", 1, 28672, 4096): _C(block_n=16, block_k=512, split_k=None, num_warps=4, num_stages=4),  # 0.85
    ("fp8", 2, 28672, 4096): _C(block_n=16, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.72
    ("fp8", 1, 4096, 14336): _C(block_n=8, block_k=1024, split_k=None, num_warps=4, num_stages=3),  # 0.84
    ("fp8", 2, 4096, 14336): _C(block_n=8, block_k=512, split_k=None, num_warps=4, num_stages=4),  # 0.69
    ("fp8", 1, 128256, 4096): _C(
        block_n=8, block_k=512, split_k=None, num_warps=4, num_stages=4, acc_2d=False
    ),
    ("fp8", 2, 128256, 4096): _C(block_n=16, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.82
    ("16bit", 1, 6144, 4096): _C(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.85
    ("16bit", 2, 6144, 4096): _C(block_n=16, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.80
    ("16bit", 4, 6144, 4096): _C(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.67
    ("16bit", 1, 4096, 4096): _C(block_n=4, block_k=512, split_k=None, num_warps=4, num_stages=4),  # o 0.76
    ("16bit", 2, 4096, 4096): _C(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.72
    ("16bit", 4, 4096, 4096): _C(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.63
    ("16bit", 1, 28672, 4096): _C(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.98
    ("16bit", 2, 28672, 4096): _C(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.95
    ("16bit", 4, 28672, 4096): _C(block_n=16, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.82
    ("16bit", 1, 4096, 14336): _C(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.94
    ("16bit", 2, 4096, 14336): _C(block_n=8, block_k=512, split_k=None, num_warps=4, num_stages=3),  # 0.93
    ("16bit", 4, 4096, 14336): _C(block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.78
    ("16bit", 1, 128256, 4096): _C(
        block_n=8, block_k=256, split_k=None, num_warps=4, num_stages=4, acc_2d=False
    ),
    ("16bit", 2, 128256, 4096): _C(block_n=16, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 1.05
    ("16bit", 4, 128256, 4096): _C(block_n=16, block_k=256, split_k=None, num_warps=4, num_stages=4),  # 0.90
}
del _C


def gemv_config_for(m: int, n: int, k: int, weight_dtype: torch.dtype) -> SplitKGemvConfig:
    """The GEMV configuration for M rows of an [N, K] weight: the measured shape's, else the
    default for the weight's width and M."""
    key = (_kind(weight_dtype), _bucket(m))
    return GEMV_TABLE.get((*key, n, k)) or GEMV_DEFAULTS[key]


def _gemv_split_k(config: SplitKGemvConfig, n: int, k: int, device: torch.device) -> int:
    """The GEMV's K split (`_splits`, `_GEMV_PROGRAMS_PER_SM` programs per SM)."""
    tiles, steps = triton.cdiv(n, config.block_n), triton.cdiv(k, config.block_k)
    return _splits(config.split_k, tiles, steps, _GEMV_PROGRAMS_PER_SM, device)


@triton.jit
def _gemv_row_step(acc, x_row_ptr, rk, k_mask, w, EVEN_K: tl.constexpr, ACC_2D: tl.constexpr):
    """acc (+)= w [BLOCK_N, BLOCK_K] times one activation row's [BLOCK_K] slice, in float32."""
    if EVEN_K:
        x = tl.load(x_row_ptr + rk)
    else:
        x = tl.load(x_row_ptr + rk, mask=k_mask, other=0.0)
    p = w * x.to(tl.float32)[None, :]
    if ACC_2D:
        acc += p
    else:
        acc += tl.sum(p, axis=1)
    return acc


@triton.jit
def _normed_row_step(
    acc, ss, x_ptr, res_ptr, norm_w_ptr, res_out_ptr, rk, k_mask, w, store_res,
    EVEN_K: tl.constexpr, ACC_2D: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """`_gemv_row_step` for the one row of an RMSNorm the kernel applies first (`GemvNorm`):
    h = x (+ residual, rounded as the norm kernel rounds it; `store_res`: this program stores it),
    acc (+)= w times norm_weight * h, and ss += h * h. The norm's 1 / rms(h), a factor of every
    output, multiplies the sums once, in the epilogue."""
    if EVEN_K:
        x = tl.load(x_ptr + rk)
        g = tl.load(norm_w_ptr + rk)
    else:
        x = tl.load(x_ptr + rk, mask=k_mask, other=0.0)
        g = tl.load(norm_w_ptr + rk, mask=k_mask, other=0.0)
    if HAS_RES:
        if EVEN_K:
            r = tl.load(res_ptr + rk)
        else:
            r = tl.load(res_ptr + rk, mask=k_mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + rk, x, mask=k_mask & store_res)
    h = x.to(tl.float32)
    ss += h * h
    p = w * (g.to(tl.float32) * h)[None, :]
    if ACC_2D:
        acc += p
    else:
        acc += tl.sum(p, axis=1)
    return acc, ss


@triton.jit
def _gemv_row_out(
    acc, row, rn, n_mask, scale, bias, out_ptr, partial_ptr, pid_k, M, N, stride_om,
    SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACC_2D: tl.constexpr,
    GLU: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One activation row's outputs: float32 partial sums of this split, or the scaled (+ bias)
    result in the output's dtype; with GLU, the program's rows are (gate, up) pairs of the
    output columns rn (`_gemv_rows`), and silu(gate) * up is stored."""
    if ACC_2D:
        y = tl.sum(acc, axis=1)
    else:
        y = acc
    if SPLIT:
        tl.store(partial_ptr + (pid_k.to(tl.int64) * M + row) * N + rn, y, mask=n_mask)
    else:
        if HAS_SCALE:
            y = y * scale
        if HAS_BIAS:
            y += bias
        if GLU:  # each product rounded to the dtype first, as the projection's output would be
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
            gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
            y = silu_and_mul_values(gate, up, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_rows(pid_n, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """(weight rows, output columns, column mask) of program pid_n. With GLU (a gate | up weight
    of N rows, N / 2 outputs) the program's BLOCK_N rows interleave the gate and up rows of
    BLOCK_N / 2 output columns, so that its epilogue holds both halves of each output. Rows past
    the matrix re-read its last row of their half (loads unmasked; stores masked)."""
    if GLU:
        outputs = N // 2
        first = pid_n.to(tl.int64) * (BLOCK_N // 2)
        pair = tl.arange(0, BLOCK_N)
        rows = tl.minimum(first + pair // 2, outputs - 1) + (pair % 2) * outputs
        rn = first + tl.arange(0, BLOCK_N // 2)
    else:
        outputs = N
        rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(rn, N - 1)
    return rows, rn, rn < outputs


@triton.jit
def _prefetch_l2(w_rows, k_begin, k_per_split, K, LINE: tl.constexpr, LINES: tl.constexpr):
    """Asks L2 for the program's weight rows (k_begin .. + k_per_split of each), one 128-byte line
    per request, LINES lines of each row at a time: issued before the PDL wait, the weight stream
    starts while the previous kernel finishes (`kernels.pdl`)."""
    lines = tl.arange(0, LINES) * LINE
    for k0 in range(0, k_per_split, LINES * LINE):
        rk = tl.minimum(k_begin + k0 + lines, K - 1)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [w_rows + rk[None, :]],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    eps,
    prefetch_len,
    ROWS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    ACC_2D: tl.constexpr,
    GLU: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    SCALE_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH_LINE: tl.constexpr,
):
    """Program (n block, k split): y[r, n] = sum over its K range of w[n, k] * x[r, k] for the
    ROWS (= M, 1..4) activation rows. EVEN_K: every split covers whole BLOCK_K steps inside K (no
    masks in the loop). GLU: silu(gate) * up of a gate | up weight (`_gemv_rows`; no split).
    NORM (one row, no split): x is RMS-normalised first (`_normed_row_step`; HAS_RES: after the
    residual add, which program 0 stores). SCALE_OUT: the epilogue multiplies by `scale` (the
    weight scales, the norm's 1 / rms, or both).
    USE_PDL (`kernels.pdl`): with PREFETCH_LINE (weight elements per 128-byte line; 0: off) the
    first `prefetch_len` elements of its K range of each weight row (weights: no kernel writes
    them) are prefetched into L2 before the wait; all else is read after."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows, rn, n_mask = _gemv_rows(pid_n, N, BLOCK_N, GLU)
    w_rows = w_ptr + rows[:, None] * stride_wn
    k_begin = pid_k.to(tl.int64) * k_per_split
    if USE_PDL and PREFETCH_LINE > 0:
        _prefetch_l2(w_rows, k_begin, prefetch_len, K, PREFETCH_LINE, 16)  # 16 x 8 rows: a request a thread
    pdl_begin(USE_PDL)
    if ACC_2D:
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)  # NORM: the row's sum of squares, per lane
    for k0 in tl.range(0, k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        rk = k_begin + k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        if EVEN_K:
            w = tl.load(w_rows + rk[None, :])
        else:
            w = tl.load(w_rows + rk[None, :], mask=k_mask[None, :], other=0.0)
        if w.dtype == tl.float8e4nv:
            w = w.to(tl.float16)  # exact (e4m3's range and 3 mantissa bits fit); one cvt per pair
        w = w.to(tl.float32)
        if NORM:
            acc0, ss = _normed_row_step(
                acc0, ss, x_ptr, res_ptr, norm_w_ptr, res_out_ptr, rk, k_mask, w, pid_n == 0,
                EVEN_K, ACC_2D, HAS_RES,
            )  # fmt: skip
        else:
            acc0 = _gemv_row_step(acc0, x_ptr, rk, k_mask, w, EVEN_K, ACC_2D)
        if ROWS > 1:
            acc1 = _gemv_row_step(acc1, x_ptr + stride_xm, rk, k_mask, w, EVEN_K, ACC_2D)
        if ROWS > 2:
            acc2 = _gemv_row_step(acc2, x_ptr + 2 * stride_xm, rk, k_mask, w, EVEN_K, ACC_2D)
        if ROWS > 3:
            acc3 = _gemv_row_step(acc3, x_ptr + 3 * stride_xm, rk, k_mask, w, EVEN_K, ACC_2D)
    scale = tl.zeros((BLOCK_N,), dtype=tl.float32)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if not SPLIT:
        if HAS_SCALE:
            scale = tl.load(scale_ptr + rows)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        if HAS_SCALE:
            scale = scale * inv_rms
        else:
            scale = scale + inv_rms
    _gemv_row_out(
        acc0, 0, rn, n_mask, scale, bias, out_ptr, partial_ptr, pid_k, M, N, stride_om,
        SPLIT, SCALE_OUT, HAS_BIAS, ACC_2D, GLU, BLOCK_N,
    )  # fmt: skip
    if ROWS > 1:
        _gemv_row_out(
            acc1, 1, rn, n_mask, scale, bias, out_ptr, partial_ptr, pid_k, M, N, stride_om,
            SPLIT, SCALE_OUT, HAS_BIAS, ACC_2D, GLU, BLOCK_N,
        )  # fmt: skip
    if ROWS > 2:
        _gemv_row_out(
            acc2, 2, rn, n_mask, scale, bias, out_ptr, partial_ptr, pid_k, M, N, stride_om,
            SPLIT, SCALE_OUT, HAS_BIAS, ACC_2D, GLU, BLOCK_N,
        )  # fmt: skip
    if ROWS > 3:
        _gemv_row_out(
            acc3, 3, rn, n_mask, scale, bias, out_ptr, partial_ptr, pid_k, M, N, stride_om,
            SPLIT, SCALE_OUT, HAS_BIAS, ACC_2D, GLU, BLOCK_N,
        )  # fmt: skip


@dataclass(frozen=True)
class GemvNorm:
    """The RMSNorm in front of a projection, applied by the GEMV itself (`gemv(..., norm=...)`).

    Why (issue 33): at one token the norm is a launch of its own, ~2 us for 8 KB of work, twice a
    layer. Taking them into the GEMVs took a bf16 llama-8b-shape token from 5.84 to 5.71 ms on an
    H100 (FP8: no change; benchmarks/results/2026-12-06-h100). The GEMV reads the row anyway. It
    adds the residual (rounded, as `kernels.layers.rms_norm` does, and stored by program 0 in
    `residual_out`), multiplies by the norm weight on the fly and sums the squares in the same
    loop. Every program covers all of K (no split), so each knows 1 / rms, which scales the
    outputs in the epilogue. The normalised row is never rounded to the model dtype, unlike the
    two launches' (an ulp-level difference, as the GEMV's own order of sums).

    Attributes:
        weight: [K] the norm's weight, in x's dtype.
        eps: the norm's epsilon.
        residual: [1, K] added to x first (the residual stream), or None.
        residual_out: [1, K] receives x + residual (given with `residual`).
    """

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: SplitKGemvConfig | None = None,
    *,
    silu_and_mul: bool = False,
    norm: GemvNorm | None = None,
) -> torch.Tensor:
    """y = x @ (weight * weight_scale[:, None])^T (+ bias) for M <= GEMV_MAX_M rows.

    Args:
        x: [M, K] activations (bf16/fp16/float32), rows contiguous.
        weight: [N, K], rows contiguous: float8_e4m3fn with `weight_scale` [N] float32, or 16-bit
            (bf16/fp16) with `weight_scale` None.
        bias: optional [N].
        config: overrides `gemv_config_for`'s (benchmarks, tests).
        silu_and_mul: weight is a gate | up projection (N even, no bias) and the result is
            `kernels.layers.silu_and_mul(y)`, [M, N / 2], made in the kernel's epilogue: no round
            trip of y through memory, no second launch. Only where `fuses_silu_and_mul` says so.
        norm: x is RMS-normalised first (`GemvNorm`). Only where `fuses_norm` says so.

    The grid and the split-K workspace depend on the shapes only (graph-safe); no host syncs.
    """
    assert x.dim() == 2 and weight.dim() == 2, "x [M, K], weight [N, K]"
    m, k = x.shape
    n = weight.shape[0]
    assert m <= GEMV_MAX_M, f"the GEMV kernel takes at most {GEMV_MAX_M} rows, got {m}"
    assert weight.shape[1] == k, f"x has K={k}, weight {tuple(weight.shape)}"
    assert weight.stride(1) == 1 or k <= 1, "weight rows must be contiguous"
    assert x.stride(1) == 1 or k <= 1, "x rows must be contiguous"
    if weight.dtype == FP8_DTYPE:
        assert weight_scale is not None and weight_scale.numel() == n
        assert weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
    else:
        assert weight.dtype in (torch.bfloat16, torch.float16), f"weight dtype {weight.dtype}"
        assert weight_scale is None, "16-bit weights take no scale"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    if silu_and_mul:
        assert bias is None and fuses_silu_and_mul(m, n, k, weight.dtype, x.device, config)
    if norm is not None:
        assert fuses_norm(m, n, k, weight.dtype, x.device, config)
        assert norm.weight.shape == (k,) and norm.weight.dtype == x.dtype and norm.weight.is_contiguous()
        assert (norm.residual is None) == (norm.residual_out is None), "residual and residual_out go together"
        for t in (norm.residual, norm.residual_out):
            assert t is None or (t.shape == x.shape and t.dtype == x.dtype and t.is_contiguous())
    out = torch.empty((m, n // 2 if silu_and_mul else n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        return out if bias is None else out.add_(bias)
    config = config or gemv_config_for(m, n, k, weight.dtype)
    split_k, k_per_split = _k_ranges(k, _gemv_split_k(config, n, k, x.device), config.block_k)
    partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    scale = weight if weight_scale is None else weight_scale  # a placeholder pointer without scales
    bias_arg = scale if bias is None else bias
    use_pdl = pdl_enabled(x.device)
    prefetch_line = 128 // weight.element_size() if use_pdl and _PREFETCH in ("1", "head") else 0
    prefetch_len = (
        k_per_split if _PREFETCH == "1" else min(k_per_split, _PREFETCH_HEAD_BYTES // weight.element_size())
    )
    has_res = norm is not None and norm.residual is not None
    norm_args = (  # pointers never read without the norm (or its residual): x stands in
        (norm.residual if has_res else x), norm.weight, (norm.residual_out if has_res else x), norm.eps
    ) if norm is not None else (x, x, x, 0.0)  # fmt: skip
    _gemv_kernel[(triton.cdiv(n, config.block_n), split_k)](
        x, weight, scale, bias_arg, out, partial, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        k_per_split, *norm_args, prefetch_len, ROWS=m, HAS_SCALE=weight_scale is not None,
        HAS_BIAS=bias is not None, SPLIT=split_k > 1, EVEN_K=k % k_per_split == 0, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages, ACC_2D=config.acc_2d, GLU=silu_and_mul, NORM=norm is not None,
        HAS_RES=has_res, SCALE_OUT=weight_scale is not None or norm is not None, USE_PDL=use_pdl,
        PREFETCH_LINE=prefetch_line, launch_pdl=use_pdl, num_warps=config.num_warps, num_stages=1,
    )  # fmt: skip
    if split_k > 1:
        _sum_splits(partial, weight_scale, bias, out)
    return out


def fuses_silu_and_mul(
    m: int,
    n: int,
    k: int,
    weight_dtype: torch.dtype,
    device: torch.device,
    config: SplitKGemvConfig | None = None,
) -> bool:
    """Whether `gemv(..., silu_and_mul=True)` takes an [N, K] gate | up weight at M rows: the
    epilogue needs whole sums, so only where the GEMV runs without a K split (the llama-8b gate_up
    at M = 1 and 2 runs 1,792-3,584 programs: never split)."""
    if not 0 < m <= GEMV_MAX_M or n % 2:
        return False
    config = config or gemv_config_for(m, n, k, weight_dtype)
    return _whole_k(n, k, device, config) and config.block_n >= 2


def fuses_norm(
    m: int,
    n: int,
    k: int,
    weight_dtype: torch.dtype,
    device: torch.device,
    config: SplitKGemvConfig | None = None,
) -> bool:
    """Whether `gemv(..., norm=...)` takes an [N, K] weight at M rows: one row (the norm's sum
    of squares is one accumulator), and no K split (each program needs the whole row's)."""
    if m != 1:
        return False
    return _whole_k(n, k, device, config or gemv_config_for(m, n, k, weight_dtype))


def _whole_k(n: int, k: int, device: torch.device, config: SplitKGemvConfig) -> bool:
    """Whether each program of the GEMV covers all of K (an epilogue that needs whole sums)."""
    if k == 0:
        return False
    split_k, _ = _k_ranges(k, _gemv_split_k(config, n, k, device), config.block_k)
    return split_k == 1


def linear_16bit(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bf16/fp16 weights and M <= GEMV_MAX_M rows, on the GEMV
    kernel (output in x's dtype)."""
    return gemv(x, weight, None, bias, x.dtype)
