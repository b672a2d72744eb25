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
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8 import FP8_DTYPE

__all__ = ["GemvConfig", "config_for", "weight_only_linear"]

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


def _split_k(config: GemvConfig, m: int, n: int, k: int, device: torch.device) -> int:
    """How many programs share each output tile's K: enough for `_PROGRAMS_PER_SM` programs per
    SM, each with at least `_MIN_K_STEPS_PER_SPLIT` loop steps (shapes only: graph-safe)."""
    if config.split_k is not None:
        return max(1, min(config.split_k, triton.cdiv(k, config.block_k)))
    tiles = triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), tiles)
    most = max(1, triton.cdiv(k, config.block_k) // _MIN_K_STEPS_PER_SPLIT)
    return max(1, min(wanted, most, _MAX_SPLIT_K))


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
):
    """out[m, n] = sum over splits of partial[s, m, n], times scale[n] (+ bias[n]), in a fixed order."""
    m = tl.program_id(1).to(tl.int64)
    rn = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + (s * M + m) * N + rn, mask=mask, other=0.0)
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
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """See `kernels.fp8.weight_only_linear`; `config` overrides the table's (benchmarks, tests)."""
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
    split_k = _split_k(config, m, n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_per_split)  # rounding up each split may leave fewer of them
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
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(triton.cdiv(n, block), m)](
            partial, weight_scale, weight_scale if bias is None else bias, out, m, n, out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out
