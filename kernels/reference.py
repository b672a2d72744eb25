"""Plain-torch references of the paged-attention kernels.

They define what the Triton kernels must compute, and they are the executor's attention on the CPU.
They favour clarity over speed: the paged KV of each sequence is gathered through its block table
and attended to with an explicit causal mask, in float32.

FP8 KV caches (`--kv-cache-dtype fp8`): the caches hold float8_e4m3fn, and `k_scale` / `v_scale`
(float32 tensors of one element, per layer) say what one unit of the cache is worth: `write_kv`
stores clamp(key / k_scale, -448, 448) rounded to e4m3, and attention reads cache * k_scale. With
caches in the model dtype the scales are ignored. The scales live in device memory, not in Python
floats, so a CUDA graph captured before they are calibrated still reads their current values.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if not is_fp8(cache):
        return x.to(cache.dtype)
    unit = 1.0 if scale is None else scale.float()
    return (x.float() / unit).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_KV_DTYPE)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """cache[blocks] in float32, dequantized (float8 tensors are indexed through a uint8 view:
    torch has no float8 gather on every backend)."""
    if not is_fp8(cache):
        return cache[blocks].float()
    raw = cache.view(torch.uint8)[blocks].view(FP8_KV_DTYPE).float()
    return raw if scale is None else raw * scale.float()


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Stores each token's key and value at its slot (block_id * block_size + offset).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place; the
            model dtype, or float8_e4m3fn (quantized with k_scale / v_scale, see the module doc).
        slot_mapping: [num_tokens] int64; a negative slot marks padding and is skipped.
        k_scale, v_scale: float32 [1]; only read for float8 caches (None there means 1.0).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_new, v_new = _to_cache(key[keep], k_cache, k_scale), _to_cache(value[keep], v_cache, v_scale)
    if is_fp8(k_cache):
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_new, v_new = k_new.view(torch.uint8), v_new.view(torch.uint8)
    k_cache[blocks, offsets] = k_new
    v_cache[blocks, offsets] = v_new


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    Args:
        q: [num_tokens, num_q_heads, head_dim]; sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1].
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: [num_seqs, max_blocks_per_seq] int32.
        seq_lens: [num_seqs] int32, context length including the sequence's new tokens.
        cu_seqlens_q: [num_seqs + 1] int32.
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [num_tokens, num_q_heads, head_dim] buffer to write into.
        k_scale, v_scale: float32 [1], the float8 caches' scales (ignored for other dtypes).
        sliding_window: a query at position p sees only keys at positions > p - sliding_window
            (its last `sliding_window` positions, itself included: Hugging Face's rule); None = all.
            Blocks wholly before the window are never read, so their table entries may be stale
            (the scheduler frees those blocks: see scheduler.kv_cache_manager).
        soft_cap: scores (after `scale`) become soft_cap * tanh(score / soft_cap) (Gemma 2).

    Returns:
        [num_tokens, num_q_heads, head_dim] in q's dtype. The j-th new token of sequence i sits at
        position seq_lens[i] - q_len_i + j and attends to every position <= its own (and within
        the window).
    """
    num_q_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    result = torch.empty_like(q) if out is None else out
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for i, context_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # The first block any of the new tokens can see (0 without a window).
        first_key = 0 if sliding_window is None else max(0, context_len - q_len - sliding_window + 1)
        first_block = first_key // block_size
        num_blocks = (context_len + block_size - 1) // block_size
        blocks = block_tables[i, first_block:num_blocks].long()
        start = first_block * block_size
        k = _gather(k_cache, blocks, k_scale).flatten(0, 1)[: context_len - start]  # [L, kv_heads, D]
        v = _gather(v_cache, blocks, v_scale).flatten(0, 1)[: context_len - start]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qi = q[q_start:q_end].float()  # [q_len, heads, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        k_pos = torch.arange(start, context_len, device=q.device)
        masked = k_pos[None, None, :] > q_pos[None, :, None]
        if sliding_window is not None:
            masked |= k_pos[None, None, :] <= q_pos[None, :, None] - sliding_window
        scores.masked_fill_(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(result.dtype)
    return result


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts of a mixture-of-experts MLP: each token through its top-k SwiGLU experts,
    the outputs summed with the routing weights. Routing itself (softmax, top-k, renormalizing)
    is the model's: families differ there.

    Args:
        x: [num_tokens, hidden].
        w13: [num_experts, 2 * inter, hidden], each expert's gate (rows :inter) and up (inter:)
            projections fused as in the dense MLP; float8_e4m3fn with `w13_scale` [num_experts,
            2 * inter] (float32, per output row) under `--quantization fp8`.
        w2: [num_experts, hidden, inter], each expert's down projection (FP8: `w2_scale`
            [num_experts, hidden]).
        topk_weights: [num_tokens, top_k] float32 routing weights.
        topk_ids: [num_tokens, top_k] integer expert ids.

    Returns:
        [num_tokens, hidden] in x's dtype.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    for expert in flat_ids.unique().tolist():
        rows = (flat_ids == expert).nonzero().squeeze(1)
        tokens = token_of[rows]
        gate_up = x[tokens].float() @ _dequantized(w13[expert], w13_scale, expert).T
        hidden = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = hidden.to(x.dtype).float() @ _dequantized(w2[expert], w2_scale, expert).T
        out.index_add_(0, tokens, down * flat_weights[rows, None])
    return out.to(x.dtype)


def _dequantized(weight: torch.Tensor, scale: torch.Tensor | None, expert: int) -> torch.Tensor:
    """One expert's weight in float32 (FP8 weights times their per-row scales)."""
    if scale is None:
        return weight.float()
    return weight.float() * scale[expert].float()[:, None]
