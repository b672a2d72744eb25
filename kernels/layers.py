"""The decoder layer's elementwise work as single kernels: (residual add +) RMSNorm, rotary, SiLU-and-mul.

Gemma's variants (`gemma_rms_norm`, `gelu_tanh_and_mul`) are plain torch on every device for now:
a few kernels each instead of one on CUDA (correct, graph-capturable, not yet fused).

In eager mode each of these is a chain of small torch ops (RMSNorm eight, rotary about twenty) with
float32 temporaries in memory; the Triton kernels (`kernels.triton_layers`) do each in one launch.
Dispatch follows `kernels.paged_attention`: Triton for CUDA tensors, the plain-torch references
below otherwise, `PAGEDSERVE_ATTENTION=reference|triton` forcing one. The references are today's
executor math, op for op, so the CPU executor keeps its numerics (and its exact match with Hugging
Face). Triton is imported only when it runs: it is absent on some CPU-only installs, and under
`TRITON_INTERPRET=1` it must be imported after that variable is set.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F

from pagedserve.kernels import _use_triton

__all__ = ["argmax", "gelu_tanh_and_mul", "gemma_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]

# `argmax` runs the Triton kernel up to this many rows of at least this many columns: torch's
# reduction gives each row one block, which reads a 128K vocabulary alone (~28 us a step at one
# request on an H100). A narrow row takes torch's few microseconds, and its one launch from the
# host is cheaper than the kernel's two (a small model's step is bound by the host).
ARGMAX_TRITON_MAX_ROWS = 64
ARGMAX_TRITON_MIN_WIDTH = 32768


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x, or of x + residual (the residual add fused in, as vLLM's fused_add_rms_norm).

    Args:
        x: [num_tokens, hidden], rows contiguous.
        weight: [hidden], x's dtype.
        eps: added to the mean square.
        residual: optional [num_tokens, hidden], x's dtype.

    Returns:
        Without residual: weight * (x / rms(x)), the reduction in float32 and rounded to x's dtype
        before the weight multiply (the Llama reference order). With residual: (that of
        s = x + residual, s), s rounded to x's dtype as torch's add does. New tensors; the
        inputs are not modified.
    """
    if _use_triton(x):
        from pagedserve.kernels import triton_layers

        return triton_layers.rms_norm(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the first column of each row's largest value, as `x.argmax(dim=-1)` (rows
    of NaN aside: torch returns a NaN's column, the kernel a number's).

    Args:
        x: [rows, width] logits, rows contiguous.
    """
    wide = x.dim() == 2 and x.shape[1] >= ARGMAX_TRITON_MIN_WIDTH and x.stride(1) == 1
    if wide and 0 < x.shape[0] <= ARGMAX_TRITON_MAX_ROWS and _use_triton(x):
        from pagedserve.kernels import triton_layers

        return triton_layers.argmax(x)
    return x.argmax(dim=-1)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates q and k in place by their tokens' positions (neox / rotate-half layout).

    Args:
        positions: [num_tokens] int64 (or int32), each < cos.shape[0].
        q: [num_tokens, num_q_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim], same dtype.
            Views are fine (the splits of a fused qkv output) as long as each head's row is contiguous.
        cos, sin: [max_len, head_dim / 2] float32 tables.

    The rotation is computed in float32 and rounded back to q/k's dtype.
    """
    if _use_triton(q):
        from pagedserve.kernels import triton_layers

        triton_layers.rotary_embedding(positions, q, k, cos, sin)
    else:
        rotary_embedding_reference(positions, q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: x [num_tokens, 2 * I] (gate | up) -> silu(gate) * up [num_tokens, I].

    As `F.silu(gate) * up`: silu in float32 rounded to x's dtype, then the multiply rounded again.
    """
    if _use_triton(x):
        from pagedserve.kernels import triton_layers

        return triton_layers.silu_and_mul(x)
    return silu_and_mul_reference(x)


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm, (1 + weight) * (x / rms(x)), with the residual add fused in as `rms_norm`.

    Unlike Llama's, the multiply by (1 + weight) happens in float32 and the result is rounded to
    x's dtype once (Hugging Face's Gemma order: folding 1 + weight into a bf16 weight would round
    it). Same arguments and returns as `rms_norm`.
    """
    if residual is not None:
        summed = x + residual
        return _gemma_normalise(summed, weight, eps), summed
    return _gemma_normalise(x, weight, eps)


def _gemma_normalise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation: x [num_tokens, 2 * I] (gate | up) -> gelu_tanh(gate) * up [num_tokens, I]
    (transformers' "gelu_pytorch_tanh", Gemma's)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# --------------------------------------------------------------------------------------------- #
# Plain-torch references: the contract, and the implementation on the CPU
# --------------------------------------------------------------------------------------------- #


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See `rms_norm`."""
    if residual is not None:
        summed = x + residual
        return _normalise(summed, weight, eps), summed
    return _normalise(x, weight, eps)


def _normalise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotary_embedding_reference(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """See `rotary_embedding`."""
    cos = cos[positions].unsqueeze(1)
    sin = sin[positions].unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """See `silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
