"""Paged-attention kernels: Triton on CUDA, the plain-torch reference on the CPU.

`paged_attention` and `write_kv` pick their implementation per call: the Triton kernels for CUDA
tensors, the reference (`kernels.reference`) otherwise. `PAGEDSERVE_ATTENTION=reference` forces the
reference; `PAGEDSERVE_ATTENTION=triton` forces Triton (on CPU tensors under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import os

import torch

from pagedserve.kernels import reference

__all__ = ["paged_attention", "write_kv", "reference"]


def _use_triton(t: torch.Tensor) -> bool:
    choice = os.environ.get("PAGEDSERVE_ATTENTION", "auto")
    if choice == "reference":
        return False
    return choice == "triton" or t.is_cuda


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out=None):
    """See `kernels.reference.paged_attention` for the contract."""
    if _use_triton(q):
        from pagedserve.kernels import triton_attention

        return triton_attention.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out
        )
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """See `kernels.reference.write_kv` for the contract."""
    if _use_triton(key):
        from pagedserve.kernels import triton_attention

        triton_attention.write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)
