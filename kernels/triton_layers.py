"""Triton kernels for the decoder layer's elementwise work: (residual add +) RMSNorm, rotary, SiLU-and-mul.

Contract: see `kernels.layers` (same arguments, same results up to rounding; the plain-torch
references there define the math). Each replaces a chain of eager torch ops (RMSNorm alone is eight)
with one launch, and keeps the float32 temporaries in registers.

Rounding follows torch's op order: every step torch rounds to the tensor dtype (the residual sum,
the normalised activations before the weight multiply, SiLU before the up multiply) is rounded here
too, and the kernels compile without FMA contraction (`enable_fp_fusion=False`) so `a * b - c * d`
rounds each product as torch's separate kernels do. What remains different is the order of the
RMSNorm sum and the approximate `exp`/`rsqrt` of the GPU: a few float32 ulps, which after rounding
to bf16/fp16 moves an element by at most one ulp, and rarely.

Launches depend on shapes only (no host synchronisation), so they can be captured in CUDA graphs;
zero tokens launch nothing. Token offsets are computed in 64 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.pdl import begin as pdl_begin
from pagedserve.kernels.pdl import launch_args as pdl_launch_args

__all__ = ["argmax", "rms_norm", "rotary_embedding", "silu_and_mul"]

# `argmax`: each row is cut into chunks of this many columns (one row of a 128K vocabulary: 63
# programs), at most `_ARGMAX_MAX_CHUNKS` of them. By the width alone: a compile-time constant
# that depended on the row count compiled the kernel again for each batch size, ~60 ms each.
_ARGMAX_CHUNK = 2048
_ARGMAX_MAX_CHUNKS = 64

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# One program normalises one whole row; beyond this the row no longer fits in registers.
_MAX_HIDDEN = 65536
# Elements per program in the rotary and SiLU kernels: enough to keep loads wide, few enough that
# short batches still spread over the SMs.
_TILE_ELEMENTS = 2048


# --------------------------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------------------------- #


@triton.jit
def rms_norm_row(
    x_ptr,
    residual_ptr,
    weight_ptr,
    residual_out_ptr,
    row,
    cols,
    mask,
    stride_x,
    stride_residual,
    stride_residual_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
):
    """(Residual add +) RMSNorm of one row, the body `_rms_norm_kernel` and
    `triton_fp8._rms_norm_quant_kernel` share: returns weight * normed in float32, not yet rounded
    to x's dtype (the caller stores or quantizes it). With a residual, stores the rounded sum
    x + residual first and normalises that."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    return weight.to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Normalises one row; with a residual, first stores the sum x + residual (rounded) and uses it."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    out = rms_norm_row(
        x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, cols, mask,
        stride_x, stride_residual, stride_residual_out, hidden, eps, HAS_RESIDUAL,
    )  # fmt: skip
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotate_heads(
    row_ptr,
    stride_head,
    first_head,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotates heads [first_head, first_head + BLOCK_H) of one token in place (rotate-half layout);
    returns the rotated halves."""
    heads = first_head + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF_PAD)
    mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]
    first = row_ptr + heads[:, None] * stride_head + cols[None, :]
    x1, x2 = rotate_half(
        tl.load(first, mask=mask, other=0.0), tl.load(first + HALF, mask=mask, other=0.0), cos, sin
    )
    tl.store(first, x1, mask=mask)
    tl.store(first + HALF, x2, mask=mask)
    return x1, x2


@triton.jit
def rotate_half(x1, x2, cos, sin):
    """The rotated halves [BLOCK_H, HALF_PAD] of heads whose first and second halves are x1 and
    x2, in float32 and rounded back to their dtype (compiled without FMA contraction: see the
    module docstring)."""
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    return (
        (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype),
        (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype),
    )


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_table,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid (token, head block): the first ceil(num_q_heads / BLOCK_H) head blocks are q's, the rest k's."""
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + position * stride_table + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + cols, mask=cols < HALF, other=0.0)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if head_block < q_blocks:
        rotate_heads(
            q_ptr + token * stride_qt,
            stride_qh,
            head_block * BLOCK_H,
            num_q_heads,
            cos,
            sin,
            HALF,
            HALF_PAD,
            BLOCK_H,
        )
    else:
        rotate_heads(
            k_ptr + token * stride_kt,
            stride_kh,
            (head_block - q_blocks) * BLOCK_H,
            num_kv_heads,
            cos,
            sin,
            HALF,
            HALF_PAD,
            BLOCK_H,
        )


@triton.jit
def silu_and_mul_values(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of float32 values that hold `dtype` ones, rounded as `F.silu(gate) * up` in
    `dtype` rounds: torch's silu formula in float32 rounded to the dtype, then the product rounded.
    `_silu_and_mul_kernel` and the GEMV's SiLU-and-mul epilogue (`triton_fp8_gemv`) share it."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    return (act.to(tl.float32) * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, intermediate, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """out[t, j] = silu(x[t, j]) * x[t, intermediate + j] for one token and BLOCK columns."""
    pdl_begin(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_x + intermediate + cols, mask=mask, other=0.0)
    out = silu_and_mul_values(gate.to(tl.float32), up.to(tl.float32), up.dtype)
    tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _argmax_chunk_kernel(
    x_ptr, values_ptr, indices_ptr, width, stride_x, chunk, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """The largest value of one row's chunk of `chunk` columns and its first column."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1).to(tl.int64) * chunk
    best = tl.full((), float("-inf"), tl.float32)
    best_col = first
    for offset in range(0, chunk, BLOCK):
        cols = first + offset + tl.arange(0, BLOCK)
        mask = (cols < width) & (offset + tl.arange(0, BLOCK) < chunk)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        value, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best_col = tl.where(value > best, first + offset + at, best_col)  # ties: the earlier column
        best = tl.maximum(best, value)
    tl.store(values_ptr + row * CHUNKS + tl.program_id(1), best)
    tl.store(indices_ptr + row * CHUNKS + tl.program_id(1), best_col)


@triton.jit
def _argmax_merge_kernel(values_ptr, indices_ptr, out_ptr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """One row's argmax from its chunks' (in column order: the first of equal maxima wins)."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK)
    mask = chunks < CHUNKS
    values = tl.load(values_ptr + row * CHUNKS + chunks, mask=mask, other=float("-inf"))
    _, at = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(indices_ptr + row * CHUNKS + at))


# --------------------------------------------------------------------------------------------- #
# Python entry points
# --------------------------------------------------------------------------------------------- #


def _num_warps(elements: int) -> int:
    return min(max(elements // 512, 1), 16)


def _check_rows(name: str, t: torch.Tensor) -> None:
    assert t.dim() == 2, f"{name} must be [num_tokens, size]"
    assert t.dtype in _SUPPORTED_DTYPES, f"{name}: unsupported dtype {t.dtype}"
    assert t.stride(1) == 1 or t.shape[1] <= 1, f"{name} rows must be contiguous"


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See `kernels.layers.rms_norm`."""
    _check_rows("x", x)
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.dtype == x.dtype and weight.stride(0) == 1
    assert hidden <= _MAX_HIDDEN, f"hidden size {hidden} > {_MAX_HIDDEN}"
    out = torch.empty_like(x)
    residual_out = None
    if residual is not None:
        _check_rows("residual", residual)
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual_out = torch.empty_like(residual)
    if num_tokens > 0:
        _launch_rms_norm(x, weight, eps, out, residual, residual_out)
    return out if residual is None else (out, residual_out)


def _launch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> None:
    block = triton.next_power_of_2(x.shape[1])
    # Without a residual its pointers are never read: x and out stand in for them.
    _rms_norm_kernel[(x.shape[0],)](
        x,
        x if residual is None else residual,
        weight,
        out,
        out if residual_out is None else residual_out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        0 if residual_out is None else residual_out.stride(0),
        x.shape[1],
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        **pdl_launch_args(x.device),
        num_warps=_num_warps(block),
        enable_fp_fusion=False,
    )


@dataclass(frozen=True)
class RotaryLaunch:
    """How `_rotary_kernel` (and `attention_jit.rotary_write_kv_kernel`) cut a token's heads:
    BLOCK_H heads of HALF_PAD columns per program, q's head blocks first, then k's."""

    half_pad: int
    block_h: int
    head_blocks: int
    num_warps: int

    @staticmethod
    def of(num_q_heads: int, num_kv_heads: int, half: int) -> RotaryLaunch:
        half_pad = triton.next_power_of_2(half)
        block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _TILE_ELEMENTS // half_pad))
        head_blocks = triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h)
        return RotaryLaunch(half_pad, block_h, head_blocks, _num_warps(block_h * half_pad))


def check_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> RotaryLaunch:
    """Checks the arguments of a rotary launch and returns its cut of the heads."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    assert q.dtype == k.dtype and q.dtype in _SUPPORTED_DTYPES
    assert q.stride(2) == 1 and k.stride(2) == 1, "q/k head rows must be contiguous"
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    assert head_dim % 2 == 0 and cos.shape[1] == half and cos.shape == sin.shape
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert positions.shape == (num_tokens,) and (positions.stride(0) == 1 or num_tokens <= 1)
    return RotaryLaunch.of(num_q_heads, k.shape[1], half)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """See `kernels.layers.rotary_embedding`."""
    launch = check_rotary(positions, q, k, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens, launch.head_blocks)](
        positions,
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        num_q_heads,
        k.shape[1],
        HALF=head_dim // 2,
        HALF_PAD=launch.half_pad,
        BLOCK_H=launch.block_h,
        num_warps=launch.num_warps,
        enable_fp_fusion=False,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See `kernels.layers.silu_and_mul`."""
    _check_rows("x", x)
    num_tokens, width = x.shape
    assert width % 2 == 0, "x must be [num_tokens, 2 * intermediate]"
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        block = min(triton.next_power_of_2(intermediate), _TILE_ELEMENTS)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
            x,
            out,
            x.stride(0),
            out.stride(0),
            intermediate,
            BLOCK=block,
            **pdl_launch_args(x.device),
            num_warps=_num_warps(block),
            enable_fp_fusion=False,
        )
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """See `kernels.layers.argmax`: each row cut into chunks, their maxima found in parallel, then
    merged (two launches; the chunks depend on the width only, so graph-safe and compiled once)."""
    _check_rows("x", x)
    rows, width = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0 or width == 0:
        return out.zero_()
    chunk = max(_ARGMAX_CHUNK, triton.cdiv(width, _ARGMAX_MAX_CHUNKS))
    chunks = triton.cdiv(width, chunk)
    values = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    indices = torch.empty((rows, chunks), dtype=torch.int64, device=x.device)
    _argmax_chunk_kernel[(rows, chunks)](
        x, values, indices, width, x.stride(0), chunk, CHUNKS=chunks,
        BLOCK=min(2048, triton.next_power_of_2(chunk)), **pdl_launch_args(x.device),
    )  # fmt: skip
    _argmax_merge_kernel[(rows,)](values, indices, out, CHUNKS=chunks, BLOCK=triton.next_power_of_2(chunks))
    return out
