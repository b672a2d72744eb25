"""FP8 (e4m3) quantization and matmuls: per-token activations, per-output-channel weights.

The scheme is vLLM's "fp8 dynamic": weights are stored in float8_e4m3fn with one float32 scale per
output row, activations are quantized per token (row) at run time, and the product
`(x_q * x_scale) @ (w_q * w_scale)^T` runs on the tensor cores through `torch._scaled_mm` with
row-wise scales (sm90) and fast accumulation (`FAST_ACCUM`), writing the model dtype.

Quantizing the activations with separate torch ops (abs, amax, scale, clamp, cast: a kernel each
and float32 temporaries) costs more than the FP8 matmul saves at decode sizes, so the quantization
is fused into the kernel that produces the activations: `rms_norm_quant` (the input and
post-attention norms, before qkv_proj and gate_up_proj), `silu_and_mul_quant` (before down_proj)
and, for the attention output (before o_proj), a single-pass `quantize_per_token`. The Triton
versions are in `kernels.triton_fp8`; dispatch follows `kernels.layers` (Triton for CUDA tensors,
the plain-torch references below otherwise, `PAGEDSERVE_ATTENTION=reference|triton` forcing one).

The references define the math: each Triton kernel first computes what the bf16 path computes
(rounded to the activation dtype at the same points), then quantizes it as `quantize_per_token`
does. Scales are floored (`MIN_SCALE`) so an all-zero row quantizes to zeros, not NaNs.

Small M (a decode step of a few sequences) takes `weight_only_linear` instead: the same e4m3
weights and scales against activations left in the model dtype, widened in registers
(`kernels.triton_fp8_gemv`); which M goes where is the executor's choice
(`executor.quantization.weight_only_max_m`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from pagedserve.kernels import _use_triton
from pagedserve.kernels.layers import rms_norm_reference, silu_and_mul_reference

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "QuantizedActivation",
    "dequantize",
    "fp8_linear",
    "fp8_linear_reference",
    "quantize_per_token",
    "quantize_per_token_reference",
    "quantize_weight",
    "rms_norm_quant",
    "silu_and_mul_quant",
    "weight_only_linear",
    "weight_only_linear_reference",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Smallest scale: a row whose largest magnitude is below FP8_MAX * MIN_SCALE (~1e-9) keeps this
# scale, so zeros stay zeros and nothing divides by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0 * 1024.0 * 4.0)
# `torch._scaled_mm(use_fast_accum=...)`: Hopper's FP8 tensor-core accumulation without the periodic
# promotion to float32 (CUTLASS's FP8FastAccum kernels, which vLLM's FP8 GEMMs use too). On the
# H200 it made W1 7% faster (12,146 -> 13,003 tok/s in one run) with the same error against bf16
# (README, FP8). PAGEDSERVE_FP8_FAST_ACCUM=0 turns it off (to measure against, or to rule it out).
FAST_ACCUM = os.environ.get("PAGEDSERVE_FP8_FAST_ACCUM", "1") != "0"


class QuantizedActivation(NamedTuple):
    """Activations quantized per token: `data` [num_tokens, K] float8_e4m3fn and `scale`
    [num_tokens, 1] float32, with data * scale ~ the activations."""

    data: torch.Tensor
    scale: torch.Tensor


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in float32, then `dtype` (scale broadcasts: [rows, 1] per row, [1] per tensor)."""
    return (q.float() * scale).to(dtype)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    # times the reciprocal, as vLLM's quantization does: one IEEE division per row, not per element
    # (the Triton kernels are bound by instruction issue; a division is ~10 instructions)
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel quantization of a [N, K] weight: (float8 [N, K], float32 scales [N])."""
    q, scale = _quantize_rows(weight)
    return q, scale.view(-1)


# --------------------------------------------------------------------------------------------- #
# Entry points (dispatch)
# --------------------------------------------------------------------------------------------- #


def quantize_per_token(x: torch.Tensor) -> QuantizedActivation:
    """x [num_tokens, K] (rows contiguous) -> per-token e4m3 data and float32 scales, one launch."""
    if _use_triton(x):
        from pagedserve.kernels import triton_fp8

        return triton_fp8.quantize_per_token(x)
    return quantize_per_token_reference(x)


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
    """`kernels.layers.rms_norm` whose normalised output is quantized per token in the same kernel.

    Returns the quantized output, and with `residual` also the new residual stream (x's dtype).
    """
    if _use_triton(x):
        from pagedserve.kernels import triton_fp8

        return triton_fp8.rms_norm_quant(x, weight, eps, residual)
    return rms_norm_quant_reference(x, weight, eps, residual)


def silu_and_mul_quant(x: torch.Tensor) -> QuantizedActivation:
    """`kernels.layers.silu_and_mul` whose output is quantized per token in the same kernel."""
    if _use_triton(x):
        from pagedserve.kernels import triton_fp8

        return triton_fp8.silu_and_mul_quant(x)
    return silu_and_mul_quant_reference(x)


def fp8_linear(
    x: QuantizedActivation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool | None = None,
) -> torch.Tensor:
    """y = (x.data * x.scale) @ (weight * weight_scale[:, None])^T (+ bias), in `out_dtype`.

    Args:
        x: per-token quantized activations [M, K].
        weight: [N, K] float8_e4m3fn, rows contiguous.
        weight_scale: [N] float32, one scale per output channel.
        bias: optional [N] in out_dtype.
        fast_accum: CUDA only, `torch._scaled_mm`'s use_fast_accum (default: FAST_ACCUM).

    On CUDA one `torch._scaled_mm` with row-wise scales (row-wise scaling writes bf16 only, so other
    model dtypes get a cast); elsewhere the float32 reference.
    """
    if x.data.is_cuda:
        out = torch._scaled_mm(
            x.data,
            weight.t(),
            scale_a=x.scale,
            scale_b=weight_scale.view(1, -1),
            out_dtype=torch.bfloat16,
            use_fast_accum=FAST_ACCUM if fast_accum is None else fast_accum,
        )
        out = out if out_dtype == torch.bfloat16 else out.to(out_dtype)
        return out if bias is None else out.add_(bias)
    return fp8_linear_reference(x, weight, weight_scale, bias, out_dtype)


def weight_only_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y = x @ (weight * weight_scale[:, None])^T (+ bias), x in the model dtype (not quantized).

    Args:
        x: [M, K] activations (bf16/fp16; float32 on the reference path), rows contiguous.
        weight: [N, K] float8_e4m3fn, rows contiguous (`Fp8Linear.weight`).
        weight_scale: [N] float32, one scale per output channel.
        bias: optional [N] in out_dtype.

    For small M, where the step is bound by reading the weights: the Triton kernel of
    `kernels.triton_fp8_gemv` for CUDA tensors (or forced, as `kernels.layers`), else the reference.
    """
    if _use_triton(x):
        from pagedserve.kernels import triton_fp8_gemv

        return triton_fp8_gemv.weight_only_linear(x, weight, weight_scale, bias, out_dtype)
    return weight_only_linear_reference(x, weight, weight_scale, bias, out_dtype)


# --------------------------------------------------------------------------------------------- #
# Plain-torch references
# --------------------------------------------------------------------------------------------- #


def quantize_per_token_reference(x: torch.Tensor) -> QuantizedActivation:
    """See `quantize_per_token`: scale = max(amax(|row|) / 448, MIN_SCALE), data = row * (1 / scale)."""
    return QuantizedActivation(*_quantize_rows(x))


def rms_norm_quant_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
    """See `rms_norm_quant`."""
    if residual is None:
        return quantize_per_token_reference(rms_norm_reference(x, weight, eps))
    normed, summed = rms_norm_reference(x, weight, eps, residual)
    return quantize_per_token_reference(normed), summed


def silu_and_mul_quant_reference(x: torch.Tensor) -> QuantizedActivation:
    """See `silu_and_mul_quant`."""
    return quantize_per_token_reference(silu_and_mul_reference(x))


def fp8_linear_reference(
    x: QuantizedActivation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """See `fp8_linear`: dequantized operands multiplied in float32."""
    out = dequantize(x.data, x.scale) @ dequantize(weight, weight_scale.view(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def weight_only_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """See `weight_only_linear`: the widened weights multiplied in float32, scaled per output."""
    out = (x.float() @ weight.float().t()) * weight_scale.view(1, -1).float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
