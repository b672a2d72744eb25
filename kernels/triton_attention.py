"""Triton kernels for paged attention and for writing new keys/values into the paged cache.

Contract: see `kernels.reference` (same arguments, same results up to rounding).

Kernel choice, by shape only
----------------------------
Launch parameters never come from tensor *values* (no `.item()`, `.tolist()` or `max(seq_lens)` on
the host), so a decode step can be captured in a CUDA graph. Which kernel runs and how big its grid
is depend only on shapes: `num_tokens = q.shape[0]`, `num_seqs = seq_lens.shape[0]`,
`max_blocks_per_seq = block_tables.shape[1]` and the head counts.

* `num_tokens == num_seqs` (every sequence has one new token in the usual case: a decode batch):
  the split-KV *decode* kernel. Its grid is (token, KV head, split). One program handles all query
  heads that share a KV head (GQA), so each KV block is read once per KV head; its query rows are
  padded to a power of two >= 16 so the products run on `tl.dot`. When tokens x KV heads alone
  cannot fill the GPU, the context is cut into `num_splits` partitions (flash-decoding) computed by
  separate programs and merged by a small reduce kernel; the split count comes from the shapes and
  the SM count. The kernel finds each token's sequence itself, and each token attends causally up
  to its own position, so the result stays correct even if `num_tokens == num_seqs` hides a
  sequence with two new tokens next to one with none.
* otherwise: the *varlen* kernel (prefill chunks, whole prompts, decodes, in any mix). Its grid is
  (virtual query tile, KV head). Sequence i owns the tile slots starting at
  `cu_seqlens_q[i] // BLOCK_Q + i`; that start is increasing in i and leaves each sequence at least
  `ceil(q_len_i / BLOCK_Q)` slots, so `num_tokens // BLOCK_Q + num_seqs` slots always suffice, and a
  program finds its sequence from `cu_seqlens_q` (one vector load and a count for up to 1024
  sequences, a binary search beyond). Slots past a sequence's last tile
  exit at once. A tile holds BLOCK_Q tokens times the (padded) query heads of one KV head group, so
  here too each KV block is read once per KV head and tile.

All pointer offsets into the caches are computed in 64 bits (block ids are cast to int64 before
they meet a stride), so pools of more than 2^15 blocks of any size are safe.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["paged_attention", "write_kv", "DecodeConfig", "PrefillConfig"]

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Split-KV policy. With the default decode config 4 programs fit on an SM at once (126 registers x
# 128 threads, by ptxas for sm_90). Decode programs of one launch are equally long, so the launch
# is as fast as its fullest wave: the split count is the smallest that fills the resident slots
# to _WAVE_EFFICIENCY (on an H200, 32 x 16384 ran 10% slower at 5 splits, 2.4 waves, than at 2 or
# 4). Batches that already fill two waves are not split.
_RESIDENT_PROGRAMS_PER_SM = 4
_WAVE_EFFICIENCY = 0.9
# A split shorter than this many tokens costs more in the reduce than it wins in parallelism.
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 64
# The varlen kernel finds its sequence with one vector load up to this many sequences, by binary
# search beyond.
_MAX_VECTOR_SEQS = 1024
_SEQS_PAD_BUCKETS = (64, 256, _MAX_VECTOR_SEQS)


# --------------------------------------------------------------------------------------------- #
# Device helpers
# --------------------------------------------------------------------------------------------- #


@triton.jit
def _find_seq(cu_seqlens_q_ptr, target, lo, hi, BLOCK_Q: tl.constexpr, TILE_SPACE: tl.constexpr):
    """Largest s in [lo, hi] with start(s) <= target, by binary search.

    start(s) is `cu_seqlens_q[s]` in token space, or `cu_seqlens_q[s] // BLOCK_Q + s` in tile space
    (see the module docstring). Both are non-decreasing in s, which is all the search needs.
    """
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_seqlens_q_ptr + mid)
        if TILE_SPACE:
            start = start // BLOCK_Q + mid
        go_right = start <= target
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@triton.jit
def _find_seq_vector(cu_seqlens_q_ptr, target, num_seqs, SEQS_PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    """`_find_seq` in tile space with one vector load instead of log2(num_seqs) dependent ones.

    Counts the sequences whose first tile slot is <= target; for batches of up to SEQS_PAD
    sequences (the start of a prefill program waits on this lookup).
    """
    idx = tl.arange(0, SEQS_PAD)
    start = tl.load(cu_seqlens_q_ptr + idx, mask=idx < num_seqs, other=1 << 30)
    start = start // BLOCK_Q + idx
    return tl.sum((start <= target).to(tl.int32), axis=0) - 1


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    block_table_ptr,
    k0,
    kv_end,
    q_pos,
    k_head_off,
    v_head_off,
    stride_kb,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vd,
    qk_scale,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BOUNDS: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One online-softmax step over the keys k0 .. k0 + BLOCK_N - 1 of one sequence and KV head.

    The keys are gathered through the block table, page by page. BOUNDS masks keys at or past
    kv_end; CAUSAL masks keys after each query row's position (q_pos). Interior blocks pass neither,
    so their loads carry no masks. Scores are kept in the log2 domain (qk_scale includes log2(e)).
    """
    kpos = k0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_PAD)
    if BOUNDS:
        kmask = kpos < kv_end
        block_ids = tl.load(block_table_ptr + kpos // PAGE_SIZE, mask=kmask, other=0)
    else:
        block_ids = tl.load(block_table_ptr + kpos // PAGE_SIZE)
    block_ids = block_ids.to(tl.int64)
    in_page = (kpos % PAGE_SIZE).to(tl.int64)
    k_rows = block_ids * stride_kb + in_page * stride_kt + k_head_off
    v_rows = block_ids * stride_vb + in_page * stride_vt + v_head_off
    k_ptrs = k_ptr + k_rows[:, None] + d[None, :] * stride_kd
    v_ptrs = v_ptr + v_rows[:, None] + d[None, :] * stride_vd
    if BOUNDS:
        if HEAD_DIM == D_PAD:
            load_mask = kmask[:, None]
        else:
            load_mask = kmask[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=load_mask, other=0.0)
        v = tl.load(v_ptrs, mask=load_mask, other=0.0)
    elif HEAD_DIM == D_PAD:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptrs, mask=d[None, :] < HEAD_DIM, other=0.0)

    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if BOUNDS:
        scores = tl.where(kmask[None, :], scores, float("-inf"))
    if CAUSAL:
        scores = tl.where(kpos[None, :] <= q_pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


# --------------------------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------------------------- #


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ckb,
    stride_ckt,
    stride_ckh,
    stride_ckd,
    stride_cvb,
    stride_cvt,
    stride_cvh,
    stride_cvd,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Copies one token's key and value of one KV head into its cache slot; slot < 0 is padding."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block_id = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        d = tl.arange(0, D_PAD)
        dmask = d < HEAD_DIM
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d * stride_kd, mask=dmask)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d * stride_vd, mask=dmask)
        k_dst = k_cache_ptr + block_id * stride_ckb + offset * stride_ckt + head * stride_ckh
        v_dst = v_cache_ptr + block_id * stride_cvb + offset * stride_cvt + head * stride_cvh
        tl.store(k_dst + d * stride_ckd, k.to(k_cache_ptr.dtype.element_ty), mask=dmask)
        tl.store(v_dst + d * stride_cvd, v.to(v_cache_ptr.dtype.element_ty), mask=dmask)


# Integer arguments that change from step to step are not specialised: Triton would otherwise
# compile a new variant whenever one of them becomes 1 or a multiple of 16, stalling serving.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "tokens_per_split"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    qk_scale,
    num_seqs,
    num_q_heads,
    num_splits,
    tokens_per_split,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One query token x one KV head group x one context partition.

    Without SPLIT the program covers the whole context and writes the output; with SPLIT it writes
    its unnormalised partial sum, running max and denominator for `_reduce_splits_kernel`.
    """
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Which sequence owns this token: token t belongs to sequence t in a pure decode batch (checked
    # with two loads); otherwise search cu_seqlens_q.
    # Which sequence owns this token: in a pure decode batch token t belongs to sequence t, which
    # two loads confirm (issued together with the context length, saving a round trip); otherwise
    # binary-search cu_seqlens_q.
    seq = token
    q_start = tl.load(cu_seqlens_q_ptr + token)
    q_end = tl.load(cu_seqlens_q_ptr + token + 1)
    seq_len = tl.load(seq_lens_ptr + token)
    if (q_start != token) | (q_end != token + 1):
        seq = _find_seq(cu_seqlens_q_ptr, token, token * 0, token * 0 + num_seqs - 1, 1, False)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
    context_end = seq_len - (q_end - token) + 1  # keys < context_end are visible to this token

    rows = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    q_heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    if HEAD_DIM == D_PAD:
        q_mask = row_mask[:, None]
    else:
        q_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    q_ptrs = q_ptr + token.to(tl.int64) * stride_qt + q_heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    kv_start = split * tokens_per_split
    kv_end = tl.minimum(kv_start + tokens_per_split, context_end)
    full_end = kv_start + tl.maximum(kv_end - kv_start, 0) // BLOCK_N * BLOCK_N
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_off = kv_head.to(tl.int64) * stride_kh
    v_head_off = kv_head.to(tl.int64) * stride_vh
    # Whole key blocks without masks, then the partial last block (if any) with them.
    for k0 in range(kv_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q,
            k_ptr,
            v_ptr,
            block_table_ptr,
            k0,
            kv_end,
            rows,
            k_head_off,
            v_head_off,
            stride_kb,
            stride_kt,
            stride_kd,
            stride_vb,
            stride_vt,
            stride_vd,
            qk_scale,
            BLOCK_N,
            PAGE_SIZE,
            HEAD_DIM,
            D_PAD,
            False,
            False,
            DOT_PREC,
            DOT_FP32,
        )
    for k0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q,
            k_ptr,
            v_ptr,
            block_table_ptr,
            k0,
            kv_end,
            rows,
            k_head_off,
            v_head_off,
            stride_kb,
            stride_kt,
            stride_kd,
            stride_vb,
            stride_vt,
            stride_vd,
            qk_scale,
            BLOCK_N,
            PAGE_SIZE,
            HEAD_DIM,
            D_PAD,
            True,
            False,
            DOT_PREC,
            DOT_FP32,
        )

    if SPLIT:
        # Partials are [num_tokens, num_q_heads, num_splits, D_PAD] and [.., num_splits], fp32.
        part = (token.to(tl.int64) * num_q_heads + q_heads) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_mask)
        tl.store(part_l_ptr + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=row_mask[:, None])
    else:
        result = acc / l_i[:, None]
        o_ptrs = (
            out_ptr + token.to(tl.int64) * stride_ot + q_heads[:, None] * stride_oh + d[None, :] * stride_od
        )
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    """Merges the split-KV partials of one (token, query head) into the final output.

    Empty partitions carry m = -inf, l = 0 and acc = 0, so they get weight 0; partition 0 is never
    empty (every token sees at least key 0), so the merged denominator is positive.
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    splits = tl.arange(0, S_PAD)
    smask = splits < num_splits
    part = (token * num_q_heads + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=smask, other=float("-inf"))
    l_part = tl.load(part_l_ptr + part, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.math.exp2(m - m_max)
    denom = tl.sum(weight * l_part, 0)
    d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + d[None, :], mask=smask[:, None], other=0.0)
    result = tl.sum(acc * weight[:, None], 0) / denom
    o_ptrs = out_ptr + token * stride_ot + head * stride_oh + d * stride_od
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_seqs", "num_tiles"])
def _varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    qk_scale,
    num_seqs,
    num_tiles,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Causal attention of BLOCK_Q new tokens x the G_PAD query heads of one KV head (one tile).

    Rows are token-major: row r is token r // G_PAD, query head r % G_PAD of the group. Keys
    before the tile's first position are visible to every row and run unmasked; the rest (the
    diagonal) run with the causal mask.
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    # Late tiles of a sequence have the most keys: hand them out first for a better tail.
    tile_slot = num_tiles - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    if SEQS_PAD > 0:
        seq = _find_seq_vector(cu_seqlens_q_ptr, tile_slot, num_seqs, SEQS_PAD, BLOCK_Q)
    else:
        zero = tile_slot * 0
        seq = _find_seq(cu_seqlens_q_ptr, tile_slot, zero, zero + num_seqs - 1, BLOCK_Q, True)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile = tile_slot - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        cached = seq_len - q_len  # context before the new tokens

        rows = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        q_tok = tile * BLOCK_Q + rows // G_PAD
        head_in_group = rows % G_PAD
        q_heads = kv_head * GROUP + head_in_group
        row_mask = (q_tok < q_len) & (head_in_group < GROUP)
        if HEAD_DIM == D_PAD:
            q_mask = row_mask[:, None]
        else:
            q_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
        q_rows = (q_start + q_tok).to(tl.int64) * stride_qt + q_heads * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :] * stride_qd, mask=q_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = cached + q_tok

        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_head_off = kv_head.to(tl.int64) * stride_kh
        v_head_off = kv_head.to(tl.int64) * stride_vh

        first_pos = cached + tile * BLOCK_Q
        kv_end = tl.minimum(cached + (tile + 1) * BLOCK_Q, seq_len)
        full_end = (first_pos // BLOCK_N) * BLOCK_N
        for k0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc,
                m_i,
                l_i,
                q,
                k_ptr,
                v_ptr,
                block_table_ptr,
                k0,
                kv_end,
                q_pos,
                k_head_off,
                v_head_off,
                stride_kb,
                stride_kt,
                stride_kd,
                stride_vb,
                stride_vt,
                stride_vd,
                qk_scale,
                BLOCK_N,
                PAGE_SIZE,
                HEAD_DIM,
                D_PAD,
                False,
                False,
                DOT_PREC,
                DOT_FP32,
            )
        for k0 in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc,
                m_i,
                l_i,
                q,
                k_ptr,
                v_ptr,
                block_table_ptr,
                k0,
                kv_end,
                q_pos,
                k_head_off,
                v_head_off,
                stride_kb,
                stride_kt,
                stride_kd,
                stride_vb,
                stride_vt,
                stride_vd,
                qk_scale,
                BLOCK_N,
                PAGE_SIZE,
                HEAD_DIM,
                D_PAD,
                True,
                True,
                DOT_PREC,
                DOT_FP32,
            )

        result = acc / l_i[:, None]
        o_rows = (q_start + q_tok).to(tl.int64) * stride_ot + q_heads * stride_oh
        o_ptrs = out_ptr + o_rows[:, None] + d[None, :] * stride_od
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=q_mask)


# --------------------------------------------------------------------------------------------- #
# Launch configuration (shapes only)
# --------------------------------------------------------------------------------------------- #


@dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch parameters of the decode kernel (keys per step, warps, pipeline depth)."""

    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PrefillConfig:
    """Tile and launch parameters of the varlen kernel; block_m = query rows (tokens x heads)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_decode_config(head_dim_pad: int, dtype: torch.dtype) -> DecodeConfig:
    """Decode reads keys and values once: enough loads in flight matters more than tile size.

    fp32 and head_dim 256 take smaller tiles so registers and shared memory suffice (checked with
    ptxas for sm_90: no spills).
    """
    if dtype == torch.float32:
        return DecodeConfig(block_n=32, num_warps=8, num_stages=2)
    if head_dim_pad >= 256:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=3)


def default_prefill_config(head_dim_pad: int, dtype: torch.dtype) -> PrefillConfig:
    """Prefill is matrix-bound: big tiles for 2-byte types, smaller ones where registers run short.

    fp32 runs its products exactly (no tensor cores) and is a correctness path, not a fast one.
    """
    if dtype == torch.float32:
        if head_dim_pad >= 256:
            return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
        return PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
    if head_dim_pad >= 256:
        return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    # On the H200 (8 x 2048 tokens, GQA 4:1, bf16) this ran as fast as (128, 128, 8 warps) and
    # (128, 64, 8 warps) within noise; the smaller query tile wastes less on short chunks.
    return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of the device; the H200's 132 stands in off the GPU (interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


@functools.lru_cache(maxsize=1024)
def choose_num_splits(
    num_tokens: int, num_kv_heads: int, max_context: int, block_n: int, sm_count: int
) -> int:
    """Split-KV partitions for the decode kernel, from shapes only.

    The smallest count whose programs (tokens x KV heads x splits) fill the GPU's resident slots
    to `_WAVE_EFFICIENCY`, else the best-filling one; never a partition shorter than
    `_MIN_TOKENS_PER_SPLIT` keys (or one key block), never more than `_MAX_SPLITS`.
    """
    base = num_tokens * num_kv_heads
    slots = _RESIDENT_PROGRAMS_PER_SM * sm_count
    if base >= 2 * slots:
        return 1
    max_splits = max(1, min(_cdiv(max_context, max(_MIN_TOKENS_PER_SPLIT, block_n)), _MAX_SPLITS))
    best, best_fill = 1, 0.0
    for splits in range(1, max_splits + 1):
        programs = base * splits
        fill = programs / (_cdiv(programs, slots) * slots)
        if fill >= _WAVE_EFFICIENCY:
            return splits
        if fill > best_fill:
            best, best_fill = splits, fill
    return best


def _cdiv(a: int, b: int) -> int:
    """Host-side ceil division. (`triton.cdiv` is a constexpr function: about 2 us per host call,
    which made a long split search cost ~150 us per launch.)"""
    return -(-a // b)


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


# --------------------------------------------------------------------------------------------- #
# Python entry points
# --------------------------------------------------------------------------------------------- #


def _check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    assert q.dim() == 3, f"q must be [num_tokens, num_q_heads, head_dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k/v caches must match, 4-d"
    assert q.shape[2] == k_cache.shape[3], "q and the caches disagree on head_dim"
    assert q.shape[1] % k_cache.shape[2] == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.dtype in _SUPPORTED_DTYPES, f"unsupported dtype {q.dtype}"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q and the caches must share a dtype"
    assert block_tables.dim() == 2 and block_tables.shape[0] == seq_lens.shape[0]
    assert cu_seqlens_q.shape == (seq_lens.shape[0] + 1,), "cu_seqlens_q must be [num_seqs + 1]"
    for t in (block_tables, seq_lens, cu_seqlens_q):
        assert t.dtype in (torch.int32, torch.int64), "index tensors must be integer"
        assert t.device == q.device, "all tensors must be on one device"
    assert seq_lens.stride(0) == 1 and cu_seqlens_q.stride(0) == 1 and block_tables.stride(1) == 1
    if out is not None:
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    decode_config: DecodeConfig | None = None,
    prefill_config: PrefillConfig | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal paged attention over a mixed batch; see `kernels.reference.paged_attention`.

    The keyword-only arguments override the shape-based choices (for tests and tuning).
    """
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if q.shape[0] == seq_lens.shape[0]:
        _launch_decode(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, decode_config, num_splits
        )
    else:
        _launch_varlen(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, prefill_config)
    return out


def _launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    config: DecodeConfig | None,
    num_splits: int | None,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    d_pad = _pow2_at_least(head_dim, 16)
    config = config or default_decode_config(d_pad, q.dtype)
    max_context = block_tables.shape[1] * page_size
    if num_splits is None:
        num_splits = choose_num_splits(
            num_tokens, num_kv_heads, max_context, config.block_n, _sm_count(q.device)
        )
    tokens_per_split = _cdiv(_cdiv(max_context, num_splits), config.block_n) * config.block_n
    num_splits = _cdiv(max_context, tokens_per_split)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            (num_tokens, num_q_heads, num_splits, d_pad), dtype=torch.float32, device=q.device
        )
        part_m = torch.empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    _decode_kernel[(num_tokens, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_m,
        part_l,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale * _LOG2E,
        seq_lens.shape[0],
        num_q_heads,
        num_splits,
        tokens_per_split,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
        GROUP=group,
        G_PAD=_pow2_at_least(group, 16),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE_SIZE=page_size,
        BLOCK_N=config.block_n,
        SPLIT=split,
        DOT_PREC=_dot_precision(q.dtype),
        DOT_FP32=_dot_in_fp32(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            part_acc,
            part_m,
            part_l,
            out,
            num_splits,
            *out.stride(),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            S_PAD=_pow2_at_least(num_splits, 2),
            num_warps=4,
        )


def _launch_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    config: PrefillConfig | None,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    d_pad = _pow2_at_least(head_dim, 16)
    config = config or default_prefill_config(d_pad, q.dtype)
    g_pad = _pow2_at_least(group)
    block_q = max(1, config.block_m // g_pad)
    if block_q * g_pad < 16:  # tl.dot needs at least 16 rows
        block_q = 16 // g_pad
    num_tiles = num_tokens // block_q + num_seqs
    _varlen_kernel[(num_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale * _LOG2E,
        num_seqs,
        num_tiles,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE_SIZE=page_size,
        BLOCK_N=config.block_n,
        SEQS_PAD=_seqs_pad(num_seqs),
        DOT_PREC=_dot_precision(q.dtype),
        DOT_FP32=_dot_in_fp32(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _seqs_pad(num_seqs: int) -> int:
    """Width of the vectorised sequence lookup: a few buckets rather than every power of two, so a
    server compiles the prefill kernel a few times at most instead of once per batch size; 0 selects
    the binary search for batches beyond _MAX_VECTOR_SEQS."""
    for bucket in _SEQS_PAD_BUCKETS:
        if num_seqs <= bucket:
            return bucket
    return 0


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the products run on fp32 operands.

    True for fp32 inputs, and for bf16 under TRITON_INTERPRET=1: the interpreter keeps bf16 as raw
    uint16 and its `tl.dot` multiplies those integers (seen with triton 3.7.1), so there the bf16
    tiles are widened first. Compiled kernels keep bf16 operands.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 products are exact ("ieee"): tf32 would cost ~1e-3 relative error."""
    return "ieee" if _dot_in_fp32(dtype) else "tf32"


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores each token's key and value at its slot; see `kernels.reference.write_kv`."""
    assert key.dim() == 3 and key.shape == value.shape, "key/value must be [num_tokens, kv_heads, head_dim]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert key.shape[1:] == k_cache.shape[2:], "key/value heads or head_dim disagree with the cache"
    assert slot_mapping.shape == (key.shape[0],) and slot_mapping.dtype in (torch.int32, torch.int64)
    assert slot_mapping.stride(0) == 1 or slot_mapping.numel() <= 1
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        D_PAD=_pow2_at_least(head_dim, 16),
        num_warps=1,
    )
