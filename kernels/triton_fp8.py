"""Triton kernels that produce per-token FP8 activations: RMSNorm + quantize, SiLU-and-mul + quantize,
and a single-pass quantize.

Contract: see `kernels.fp8` (the plain-torch references there define the math). One program owns
one whole row (token): the per-token scale needs the row's largest magnitude before any element
can be stored, and a row of up to `_MAX_ROW` elements fits in registers, so each kernel reads its
input once and writes one byte per element plus one float32 scale, instead of writing the bf16
activations and reading them back in a separate quantize pass (vLLM's fused_add_rms_norm +
dynamic per-token quant, in one launch).

As in `kernels.triton_layers`, every value torch rounds to the activation dtype is rounded here
too and FMA contraction is off, so the pre-quantization values match the bf16 path's; the e4m3
cast rounds to nearest even and saturates (the clamp). Launches depend on shapes only (CUDA
graphs); offsets are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, QuantizedActivation
from pagedserve.kernels.triton_layers import _check_rows, _num_warps, rms_norm_row

__all__ = ["quantize_per_token", "rms_norm_quant", "silu_and_mul_quant"]

_MAX_ROW = 65536
FP8_MAX_C = tl.constexpr(FP8_MAX)
MIN_SCALE_C = tl.constexpr(MIN_SCALE)


@triton.jit
def _store_quantized(q_ptr, scale_ptr, row, stride_q, cols, mask, y):
    """Quantizes one row y (float32, already rounded to the activation dtype) and stores it."""
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
    # IEEE divisions (`/` compiles to an approximate one), so scales and data match torch's; the data
    # is multiplied by the row's reciprocal (the per-element division was 23% of the SiLU kernel's
    # instructions, which is bound by instruction issue)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX_C), MIN_SCALE_C)
    q = tl.clamp(y * tl.math.div_rn(1.0, scale), -FP8_MAX_C, FP8_MAX_C)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    y = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _store_quantized(q_ptr, scale_ptr, row, stride_q, cols, mask, y)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    q_ptr,
    scale_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_q,
    stride_residual_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """`triton_layers._rms_norm_kernel` (the same `rms_norm_row`), then the row rounded to x's dtype
    and quantized instead of stored."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    y = rms_norm_row(
        x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, cols, mask,
        stride_x, stride_residual, stride_residual_out, hidden, eps, HAS_RESIDUAL,
    )  # fmt: skip
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_quantized(q_ptr, scale_ptr, row, stride_q, cols, mask, y)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, intermediate, BLOCK: tl.constexpr
):
    """`triton_layers._silu_and_mul_kernel` over a whole row, then the row quantized."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype).to(tl.float32)
    _store_quantized(q_ptr, scale_ptr, row, stride_q, cols, mask, y)


def _outputs(num_tokens: int, width: int, device: torch.device) -> QuantizedActivation:
    assert width <= _MAX_ROW, f"row of {width} elements > {_MAX_ROW}"
    return QuantizedActivation(
        torch.empty((num_tokens, width), dtype=FP8_DTYPE, device=device),
        torch.empty((num_tokens, 1), dtype=torch.float32, device=device),
    )


def quantize_per_token(x: torch.Tensor) -> QuantizedActivation:
    """See `kernels.fp8.quantize_per_token`."""
    _check_rows("x", x)
    num_tokens, width = x.shape
    out = _outputs(num_tokens, width, x.device)
    if num_tokens > 0:
        block = triton.next_power_of_2(width)
        _quant_kernel[(num_tokens,)](
            x, out.data, out.scale, x.stride(0), out.data.stride(0), width,
            BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return out


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
    """See `kernels.fp8.rms_norm_quant`."""
    _check_rows("x", x)
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.dtype == x.dtype and weight.stride(0) == 1
    out = _outputs(num_tokens, hidden, x.device)
    residual_out = None
    if residual is not None:
        _check_rows("residual", residual)
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual_out = torch.empty_like(residual)
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_quant_kernel[(num_tokens,)](
            x,
            x if residual is None else residual,
            weight,
            out.data,
            out.scale,
            out.data if residual_out is None else residual_out,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            out.data.stride(0),
            0 if residual_out is None else residual_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
            enable_fp_fusion=False,
        )
    return out if residual is None else (out, residual_out)


def silu_and_mul_quant(x: torch.Tensor) -> QuantizedActivation:
    """See `kernels.fp8.silu_and_mul_quant`."""
    _check_rows("x", x)
    num_tokens, width = x.shape
    assert width % 2 == 0, "x must be [num_tokens, 2 * intermediate]"
    intermediate = width // 2
    out = _outputs(num_tokens, intermediate, x.device)
    if num_tokens > 0:
        block = triton.next_power_of_2(intermediate)
        _silu_and_mul_quant_kernel[(num_tokens,)](
            x, out.data, out.scale, x.stride(0), out.data.stride(0), intermediate,
            BLOCK=block, num_warps=_num_warps(block), enable_fp_fusion=False,
        )  # fmt: skip
    return out
