"""Paged-attention and fused-MoE kernels: Triton on CUDA, the plain-torch reference on the CPU.

`paged_attention`, `write_kv` and `fused_moe` pick their implementation per call: the Triton
kernels for CUDA tensors, the reference (`kernels.reference`) otherwise.
`PAGEDSERVE_ATTENTION=reference` forces the reference; `PAGEDSERVE_ATTENTION=triton` forces Triton
(on CPU tensors under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import os

import torch

from pagedserve.kernels import reference

__all__ = [
    "fused_moe",
    "paged_attention",
    "rotary_paged_attention",
    "rotary_write_kv",
    "write_kv",
    "reference",
]


def _use_triton(t: torch.Tensor) -> bool:
    choice = os.environ.get("PAGEDSERVE_ATTENTION", "auto")
    if choice == "reference":
        return False
    return choice == "triton" or t.is_cuda


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    scale,
    out=None,
    k_scale=None,
    v_scale=None,
    sliding_window=None,
    soft_cap=None,
):
    """See `kernels.reference.paged_attention` for the contract (k_scale/v_scale: FP8 caches;
    sliding_window, soft_cap: Mistral's and Gemma's attention)."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out)
    if _use_triton(q):
        from pagedserve.kernels import triton_attention

        return triton_attention.paged_attention(
            *args, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
    return reference.paged_attention(*args, k_scale, v_scale, sliding_window, soft_cap)


def fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None):
    """See `kernels.reference.fused_moe` for the contract; the Triton kernels of `kernels.fused_moe`
    on CUDA tensors (or forced, as for attention), the reference otherwise."""
    if _use_triton(x):
        from pagedserve.kernels import triton_moe

        return triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return reference.fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """See `kernels.reference.write_kv` for the contract (k_scale/v_scale: FP8 caches)."""
    if _use_triton(key):
        from pagedserve.kernels import triton_attention

        triton_attention.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rotary_write_kv(
    positions, q, key, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None
) -> None:
    """Rotates q and key in place (`kernels.layers.rotary_embedding`: whole rotate-half heads) and
    writes key and value to their slots (`write_kv`). One Triton launch instead of two on CUDA: a
    decode layer's rotary and KV write are each a few-microsecond kernel whose time is launch and
    latency; the references one after the other otherwise."""
    if _use_triton(key):
        from pagedserve.kernels import triton_attention

        triton_attention.rotary_write_kv(
            positions, q, key, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale
        )
    else:
        from pagedserve.kernels import layers  # it imports this module

        layers.rotary_embedding_reference(positions, q, key, cos, sin)
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rotary_paged_attention(
    positions,
    q,
    key,
    value,
    cos,
    sin,
    k_cache,
    v_cache,
    slot_mapping,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    scale,
    *,
    decode_only=False,
    k_scale=None,
    v_scale=None,
    sliding_window=None,
    soft_cap=None,
):
    """`rotary_write_kv` then `paged_attention` (whose result it returns). On CUDA, in a decode step
    (decode_only: every sequence has exactly one new token) over caches in q's dtype, the decode
    kernel rotates and writes the new keys itself: a small-batch decode layer's rotary launch costs
    its launch and the wait for the one before, not its work (issue 33). q and key are then left
    unrotated; the caches and the result are the two launches'."""
    options = dict(k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if _use_triton(q):
        from pagedserve.kernels import triton_attention

        return triton_attention.rotary_paged_attention(
            positions, q, key, value, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
            cu_seqlens_q, scale, decode_only=decode_only, **options,
        )  # fmt: skip
    rotary_write_kv(positions, q, key, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, **options)
