"""The Triton device code of the paged-attention kernels: decode (split-KV; also the decodes of a
mixed batch), the merge of its splits, varlen (the prefill chunks and prompts of a mixed batch) and
the KV write.

`kernels.triton_attention` explains the design, chooses every launch parameter from shapes, and
launches these; nothing here is meant to be called from elsewhere.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedserve.kernels.pdl import begin as pdl_begin
from pagedserve.kernels.triton_layers import rotate_heads

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
def _find_seq_vector(
    cu_seqlens_q_ptr, seq_lens_ptr, target, num_seqs, SEQS_PAD: tl.constexpr, BLOCK_Q: tl.constexpr
):
    """`_find_seq` in tile space with vector loads instead of log2(num_seqs) dependent ones.

    Counts the sequences whose first tile slot is <= target, for batches of up to SEQS_PAD
    sequences, and picks that sequence's q_start, q_end and length out of the same (parallel)
    loads: the start of a prefill program waits one memory round trip for all four, not three.
    Returns (seq, q_start, q_end, seq_len).
    """
    idx = tl.arange(0, SEQS_PAD)
    in_batch = idx < num_seqs
    starts = tl.load(cu_seqlens_q_ptr + idx, mask=in_batch, other=0)
    ends = tl.load(cu_seqlens_q_ptr + 1 + idx, mask=in_batch, other=0)
    lens = tl.load(seq_lens_ptr + idx, mask=in_batch, other=0)
    first_slot = tl.where(in_batch, starts // BLOCK_Q + idx, 1 << 30)
    seq = tl.sum((first_slot <= target).to(tl.int32), axis=0) - 1
    mine = idx == seq
    q_start = tl.sum(tl.where(mine, starts, 0), axis=0)
    q_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    seq_len = tl.sum(tl.where(mine, lens, 0), axis=0)
    return seq, q_start, q_end, seq_len


# How FP8 K/V tiles are widened for the products (the kernels' KV_FP8 constexpr; 0: caches in the
# model dtype). Chosen per kernel by `triton_attention` (measured: README, FP8).
WIDEN_TO_Q_DTYPE = tl.constexpr(
    1
)  # plain casts to q's dtype (bf16 goes e4m3 -> f16 -> f32 -> bf16: 3 cvt per value)
WIDEN_TO_F16 = tl.constexpr(
    2
)  # K cast to float16, V through `_widen_v_e4m3`, q cast to float16 once per program


@triton.jit
def _widen_v_e4m3(v):
    """A V tile of e4m3 -> float16 (exact: every e4m3 value, subnormals included, is a float16), two
    values per `cvt.rn.f16x2.e4m3x2` (sm_89+), as inline asm with side effects, which hides the
    conversion from Triton's layout passes.

    With a plain cast those passes move the conversion after the layout change into the dot
    operand, so the one-byte tile is read out of shared memory in the operand's layout. For V that
    layout pairs values along the keys (the product's reduction axis) while the cache is contiguous
    along head_dim: one 8-bit shared-memory load per element (ptxas for sm_90: 190 LDS against 14 in
    the bf16 kernel's loop). Hidden, the tile is read in its load layout (16-byte vectors), widened,
    and the 16-bit tile reaches the operand through shared memory as in the bf16 kernel
    (ldmatrix.trans). K needs no help: its operand is contiguous along head_dim, the reduction axis.
    The interpreter has no inline asm (it runs WIDEN_TO_Q_DTYPE).
    """
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [v.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def _q_to_f16(q):
    """q for products with widened FP8 K/V. bf16 -> float16 is exact on float16's normal range
    (float16 has 3 more mantissa bits); clamped to +-65504 so an outlier saturates, not overflows."""
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _tanh(x):
    """tanh from one exp2 (Triton has no tanh on every version and backend): 1 - 2 / (e^2x + 1),
    which saturates to +-1 as x goes to +-inf; its absolute error stays at float32 rounding."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit
def _load_block_ids(
    block_table_ptr, k0, limit, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr
):
    """Block ids (int64) of the keys k0 .. k0 + BLOCK_N - 1, one per key; keys >= limit get block 0
    when MASKED (never dereferenced: their K/V loads are masked too)."""
    kpos = k0 + tl.arange(0, BLOCK_N)
    if MASKED:
        block_ids = tl.load(block_table_ptr + kpos // PAGE_SIZE, mask=kpos < limit, other=0)
    else:
        block_ids = tl.load(block_table_ptr + kpos // PAGE_SIZE)
    return block_ids.to(tl.int64)


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    block_ids,
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
    cap_scale,
    window,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BOUNDS: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One online-softmax step over the keys k0 .. k0 + BLOCK_N - 1 of one sequence and KV head.

    block_ids holds each key's block (from `_load_block_ids`). BOUNDS masks keys at or past kv_end;
    CAUSAL masks keys after each query row's position (q_pos). Interior blocks pass neither, so
    their loads carry no masks. K and V are both requested before the first product needs K.
    Scores stay in the log2 domain; the scale (which includes log2(e)) is applied inside the exponent
    (one fused multiply-add per score instead of a multiply and a subtract).
    KV_FP8: the caches hold e4m3; K and V are widened in registers (exact; to q's dtype or to
    float16, see WIDEN_*) and their scales are applied outside the products (k_scale inside
    qk_scale, v_scale to the result).
    SOFT_CAP: scores become tanh(scores * cap_scale) before the softmax (the caller has folded the
    softmax scale over the cap into cap_scale, and the cap itself into qk_scale).
    WINDOW masks keys at or before q_pos - window for each row (a sliding window). A row can then
    see no key of a tile while its running max is still -inf; the exponents then use 0 instead of
    -inf, so that the row's state stays (-inf, 0, 0) rather than becoming NaN.
    """
    kpos = k0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_PAD)
    in_page = (kpos % PAGE_SIZE).to(tl.int64)
    k_rows = block_ids * stride_kb + in_page * stride_kt + k_head_off
    v_rows = block_ids * stride_vb + in_page * stride_vt + v_head_off
    k_ptrs = k_ptr + k_rows[:, None] + d[None, :] * stride_kd
    v_ptrs = v_ptr + v_rows[:, None] + d[None, :] * stride_vd
    if BOUNDS:
        kmask = kpos < kv_end
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
    elif KV_FP8 == WIDEN_TO_F16:
        k = k.to(tl.float16)
        v = _widen_v_e4m3(v)
    elif KV_FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if SOFT_CAP:
        scores = _tanh(scores * cap_scale)
    if BOUNDS:
        scores = tl.where((kpos < kv_end)[None, :], scores, float("-inf"))
    if CAUSAL:
        scores = tl.where(kpos[None, :] <= q_pos[:, None], scores, float("-inf"))
    if WINDOW:
        scores = tl.where(kpos[None, :] > q_pos[:, None] - window, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    if WINDOW:
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_exp = m_new
    alpha = tl.math.exp2(m_i - m_exp)
    p = tl.math.exp2(scores * qk_scale - m_exp[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _attend_range(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    block_table_ptr,
    kv_lo,
    band_end,
    full_end,
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
    cap_scale,
    window,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """The keys kv_lo .. kv_end - 1 in tiles of BLOCK_N from kv_lo (not necessarily a multiple of
    BLOCK_N: a sliding window starts where it starts, and no key before kv_lo is ever loaded).

    A tile runs without any mask when every key in it is at or after band_end (inside every row's
    window; WINDOW only) and before full_end (visible to every row: causally, and before kv_end);
    the others run with the length mask, the causal one if CAUSAL and the window's if WINDOW. So
    the masked tiles are the first few (the window's lower edge, WINDOW only) and the last few (the
    diagonal and the end). Each tile loads its block ids in the loop, which Triton's software
    pipeliner prefetches a stage ahead of the K/V loads they address. Without WINDOW the loops are
    the kernels' original ones (the unmasked tiles first).
    """
    span = tl.maximum(kv_end - kv_lo, 0)
    n_total = (span + BLOCK_N - 1) // BLOCK_N
    n_full = tl.minimum(tl.maximum(full_end - kv_lo, 0) // BLOCK_N, n_total)
    if WINDOW:
        # Masked: tiles [0, n_band) (the window's lower edge) and [max(n_band, n_full), n_total)
        # (the diagonal and the end), in one loop so that the kernel holds one masked tile body
        # (two made the fp32 and the tall-tile variants spill: ptxas, sm_90). The unmasked tiles
        # come last; a row that has seen no key before one enters it with a running max of -inf,
        # which the tile's finite scores replace (its alpha is 0).
        n_band = tl.minimum((tl.maximum(band_end - kv_lo, 0) + BLOCK_N - 1) // BLOCK_N, n_total)
        n_after = tl.maximum(n_band, n_full)
        for t in range(0, n_band + n_total - n_after):
            k0 = kv_lo + tl.where(t < n_band, t, t - n_band + n_after) * BLOCK_N
            block_ids = _load_block_ids(block_table_ptr, k0, kv_end, BLOCK_N, PAGE_SIZE, True)
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, k_ptr, v_ptr, block_ids, k0, kv_end, q_pos, k_head_off, v_head_off,
                stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, qk_scale, cap_scale,
                window, BLOCK_N, PAGE_SIZE, HEAD_DIM, D_PAD, True, CAUSAL, True, SOFT_CAP, DOT_PREC,
                DOT_FP32, KV_FP8,
            )  # fmt: skip
        for k0 in range(kv_lo + n_band * BLOCK_N, kv_lo + n_full * BLOCK_N, BLOCK_N):
            block_ids = _load_block_ids(block_table_ptr, k0, kv_end, BLOCK_N, PAGE_SIZE, False)
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, k_ptr, v_ptr, block_ids, k0, kv_end, q_pos, k_head_off, v_head_off,
                stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, qk_scale, cap_scale,
                window, BLOCK_N, PAGE_SIZE, HEAD_DIM, D_PAD, False, False, False, SOFT_CAP, DOT_PREC,
                DOT_FP32, KV_FP8,
            )  # fmt: skip
    else:
        for k0 in range(kv_lo, kv_lo + n_full * BLOCK_N, BLOCK_N):
            block_ids = _load_block_ids(block_table_ptr, k0, kv_end, BLOCK_N, PAGE_SIZE, False)
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, k_ptr, v_ptr, block_ids, k0, kv_end, q_pos, k_head_off, v_head_off,
                stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, qk_scale, cap_scale,
                window, BLOCK_N, PAGE_SIZE, HEAD_DIM, D_PAD, False, False, False, SOFT_CAP, DOT_PREC,
                DOT_FP32, KV_FP8,
            )  # fmt: skip
        for k0 in range(kv_lo + n_full * BLOCK_N, kv_end, BLOCK_N):
            block_ids = _load_block_ids(block_table_ptr, k0, kv_end, BLOCK_N, PAGE_SIZE, True)
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, k_ptr, v_ptr, block_ids, k0, kv_end, q_pos, k_head_off, v_head_off,
                stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, qk_scale, cap_scale,
                window, BLOCK_N, PAGE_SIZE, HEAD_DIM, D_PAD, True, CAUSAL, False, SOFT_CAP, DOT_PREC,
                DOT_FP32, KV_FP8,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _fp8_cache_values(x, scale_ptr):
    """x quantized for an e4m3 cache: divided by the layer's scale (IEEE division, as the reference:
    `/` compiles to an approximate one) and saturated."""
    return tl.clamp(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), -448.0, 448.0)


@triton.jit
def _cache_values(x, scale_ptr, cache_ptr, KV_FP8: tl.constexpr):
    """x as its cache stores it: cast to the cache's dtype, quantized first for an e4m3 cache."""
    y = x.to(tl.float32)
    if KV_FP8:
        y = _fp8_cache_values(y, scale_ptr)
    return y.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rotate(x, partner, d, cos_ptr, sin_ptr, position, stride_table, HALF: tl.constexpr):
    """Rows [R, 2 * HALF] of rotate-half heads at one position, rotated as
    `triton_layers.rotate_half` rotates them: x * cos - partner * sin in the first half and
    x * cos + partner * sin in the second, where partner is the same row's other half (column
    d + HALF or d - HALF), in float32 and rounded to x's dtype. Negating sin is exact, so with FMA
    contraction off (the launch compiles without it) every value rounds as the rotary kernel's."""
    table = position * stride_table + d % HALF
    cos = tl.load(cos_ptr + table)
    sin = tl.load(sin_ptr + table)
    sin = tl.where(d < HALF, -sin, sin)
    return (x.to(tl.float32) * cos[None, :] + partner.to(tl.float32) * sin[None, :]).to(x.dtype)


# --------------------------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------------------------- #


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    KV_FP8: tl.constexpr,
):
    """Copies one token's key and value of one KV head into its cache slot; slot < 0 is padding.
    KV_FP8: quantizes them to e4m3 with the layer's scales first (saturating, as the reference)."""
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
        if KV_FP8:
            k, v = _fp8_cache_values(k, k_scale_ptr), _fp8_cache_values(v, v_scale_ptr)
        k_dst = k_cache_ptr + block_id * stride_ckb + offset * stride_ckt + head * stride_ckh
        v_dst = v_cache_ptr + block_id * stride_cvb + offset * stride_cvt + head * stride_cvh
        tl.store(k_dst + d * stride_ckd, k.to(k_cache_ptr.dtype.element_ty), mask=dmask)
        tl.store(v_dst + d * stride_cvd, v.to(v_cache_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def rotary_write_kv_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_table,
    stride_ckb,
    stride_ckt,
    stride_ckh,
    stride_cvb,
    stride_cvt,
    stride_cvh,
    num_q_heads,
    num_kv_heads,
    PAGE_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (token, head block), as `triton_layers._rotary_kernel`'s: the first head blocks rotate
    q's heads in place; the others rotate k's in place and store those keys and the values at the
    token's cache slot (none for padding, slot < 0), quantized as `write_kv_kernel` does for e4m3
    caches. Heads are whole rotate-half rows (head_dim = 2 * HALF, rows contiguous)."""
    pdl_begin(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + position * stride_table + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + cols, mask=cols < HALF, other=0.0)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if head_block < q_blocks:
        rotate_heads(
            q_ptr + token * stride_qt, stride_qh, head_block * BLOCK_H, num_q_heads, cos, sin,
            HALF, HALF_PAD, BLOCK_H,
        )  # fmt: skip
    else:
        first_head = (head_block - q_blocks) * BLOCK_H
        k1, k2 = rotate_heads(
            k_ptr + token * stride_kt, stride_kh, first_head, num_kv_heads, cos, sin, HALF, HALF_PAD, BLOCK_H
        )
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            heads = (first_head + tl.arange(0, BLOCK_H)).to(tl.int64)
            mask = (heads < num_kv_heads)[:, None] & (cols < HALF)[None, :]
            v_first = v_ptr + token * stride_vt + heads[:, None] * stride_vh + cols[None, :]
            v1 = tl.load(v_first, mask=mask, other=0.0)
            v2 = tl.load(v_first + HALF, mask=mask, other=0.0)
            block_id = slot // PAGE_SIZE
            offset = slot % PAGE_SIZE
            k_dst = k_cache_ptr + block_id * stride_ckb + offset * stride_ckt + heads[:, None] * stride_ckh
            v_dst = v_cache_ptr + block_id * stride_cvb + offset * stride_cvt + heads[:, None] * stride_cvh
            tl.store(k_dst + cols[None, :], _cache_values(k1, k_scale_ptr, k_cache_ptr, KV_FP8), mask=mask)
            tl.store(
                k_dst + HALF + cols[None, :], _cache_values(k2, k_scale_ptr, k_cache_ptr, KV_FP8), mask=mask
            )
            tl.store(v_dst + cols[None, :], _cache_values(v1, v_scale_ptr, v_cache_ptr, KV_FP8), mask=mask)
            tl.store(
                v_dst + HALF + cols[None, :], _cache_values(v2, v_scale_ptr, v_cache_ptr, KV_FP8), mask=mask
            )


# Integer arguments that change from step to step are not specialised: Triton would otherwise
# compile a new variant whenever one of them becomes 1 or a multiple of 16, stalling serving. That
# includes the block table's row stride: eager steps pass tables as wide as their longest sequence.
_VARYING = ("num_seqs", "stride_bt")


@triton.jit(
    do_not_specialize=[*_VARYING, "num_splits", "tokens_per_split", "table_tokens", "part_rows", "window"]
)
def decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    k_scale_ptr,
    v_scale_ptr,
    positions_ptr,
    new_k_ptr,
    new_v_ptr,
    cos_ptr,
    sin_ptr,
    slot_mapping_ptr,
    qk_scale,
    cap_scale,
    window,
    num_seqs,
    num_splits,
    tokens_per_split,
    table_tokens,
    part_rows,
    stride_nkt,
    stride_nkh,
    stride_nvt,
    stride_nvh,
    stride_table,
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
    SINGLE_TILE: tl.constexpr,
    FIT_SPLITS: tl.constexpr,
    BY_SEQ: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
    ROTARY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One decode token x one KV head group x one context partition (split).

    Grid row r is token r (a decode batch), or with BY_SEQ sequence r of a mixed batch, whose token
    this is only if it has exactly one new token (other rows exit; the varlen kernel takes them).
    Without SPLIT the program covers the whole context and writes the output; with SPLIT it writes
    its partial result for `merge_kernel`. SINGLE_TILE (tokens_per_split == BLOCK_N) loads the
    split's block ids before the sequence length is known, assuming that the token's sequence is
    the token's index (true in a decode batch; reloaded otherwise) or knowing it (BY_SEQ), so the
    first K/V loads wait one memory round trip, not two.
    WINDOW (a sliding window of `window` keys): the token sees only its last `window` positions, so
    the splits partition those (tokens_per_split comes from the window, not the table) and start at
    the window's first key; no key before it is loaded (its block may be freed or reused). The
    window's start depends on the sequence length, so SINGLE_TILE loads its block ids after it.
    FIT_SPLITS (looping splits): the splits partition the token's own context, not the table's
    (`tokens_per_split` is the most a split takes): the split count is fixed when a CUDA graph is
    captured for the longest context, and a short context would otherwise fill a few splits with
    several key tiles each, leaving the rest of the grid idle.
    SOFT_CAP: see `_attend_block`.
    ROTARY (a decode batch in which every sequence has exactly one new token; whole rotate-half
    heads, HEAD_DIM == D_PAD = 2 * HALF; caches in q's dtype): the kernel also does
    `rotary_write_kv_kernel`'s work, one launch fewer per layer. q and the new keys arrive
    unrotated (new_k_ptr, new_v_ptr: the step's keys and values). Every program rotates its q rows
    in registers. The program whose split holds the token's own position (the context's last key)
    also rotates that key, stores it and the value at the token's slot, and waits at a barrier of
    its block before it loads K/V, so that its tile holds them. No other program reads that slot:
    the splits partition the context, and only this token's sequence owns it.
    """
    pdl_begin(USE_PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_start = split * tokens_per_split  # from the window's first key with WINDOW (below)
    rows = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    HALF = D_PAD // 2  # ROTARY's rotate-half
    q_heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    if HEAD_DIM == D_PAD:
        q_mask = row_mask[:, None]
    else:
        q_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    if SINGLE_TILE and not WINDOW:
        block_ids = _load_block_ids(
            block_tables_ptr + row.to(tl.int64) * stride_bt, kv_start, table_tokens, BLOCK_N, PAGE_SIZE, True
        )

    # Which sequence owns the token, and which token the row is.
    seq = row
    q_start = tl.load(cu_seqlens_q_ptr + row)
    q_end = tl.load(cu_seqlens_q_ptr + row + 1)
    seq_len = tl.load(seq_lens_ptr + row)
    if BY_SEQ:
        token = q_start
        is_decode = q_end - q_start == 1
    else:
        # In a pure decode batch token t belongs to sequence t, which the two loads above confirm;
        # otherwise binary-search.
        token = row
        is_decode = True
        if (q_start != token) | (q_end != token + 1):
            seq = _find_seq(cu_seqlens_q_ptr, token, token * 0, token * 0 + num_seqs - 1, 1, False)
            q_start = tl.load(cu_seqlens_q_ptr + seq)
            q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
            seq_len = tl.load(seq_lens_ptr + seq)
            if SINGLE_TILE and not WINDOW:
                block_ids = _load_block_ids(
                    block_tables_ptr + seq.to(tl.int64) * stride_bt,
                    kv_start,
                    table_tokens,
                    BLOCK_N,
                    PAGE_SIZE,
                    True,
                )
    if is_decode:
        q_ptrs = (
            q_ptr + token.to(tl.int64) * stride_qt + q_heads[:, None] * stride_qh + d[None, :] * stride_qd
        )
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        if ROTARY:
            position = tl.load(positions_ptr + token).to(tl.int64)
            partner = tl.where(d < HALF, HALF, -HALF)  # column offset of each column's other half
            q_partner = tl.load(q_ptrs + partner[None, :] * stride_qd, mask=q_mask, other=0.0)
            q = _rotate(q, q_partner, d, cos_ptr, sin_ptr, position, stride_table, HALF)
        if DOT_FP32:
            q = q.to(tl.float32)
        if KV_FP8:
            if SOFT_CAP:
                cap_scale = cap_scale * tl.load(k_scale_ptr)
            else:
                qk_scale = qk_scale * tl.load(k_scale_ptr)
            if KV_FP8 == WIDEN_TO_F16:
                q = _q_to_f16(q)
        context_end = seq_len - (q_end - token) + 1  # keys < context_end are visible to this token
        first_key = 0
        if WINDOW:
            first_key = tl.maximum(context_end - window, 0)
        if FIT_SPLITS:  # whole key tiles, as few per split as fill num_splits (at least one)
            tokens_per_split = tl.cdiv(tl.cdiv(context_end - first_key, num_splits), BLOCK_N) * BLOCK_N
            kv_start = split * tokens_per_split
        kv_start += first_key

        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        kv_end = tl.minimum(kv_start + tokens_per_split, context_end)
        k_head_off = kv_head.to(tl.int64) * stride_kh
        v_head_off = kv_head.to(tl.int64) * stride_vh
        if ROTARY:
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
            if (kv_start < kv_end) & (kv_end == context_end) & (slot >= 0):  # this split holds the token
                new_k = new_k_ptr + token.to(tl.int64) * stride_nkt + kv_head * stride_nkh + d[None, :]
                new_v = new_v_ptr + token.to(tl.int64) * stride_nvt + kv_head * stride_nvh + d[None, :]
                key = _rotate(
                    tl.load(new_k), tl.load(new_k + partner[None, :]), d, cos_ptr, sin_ptr, position,
                    stride_table, HALF,
                )  # fmt: skip
                in_page = slot % PAGE_SIZE
                k_dst = k_ptr + (slot // PAGE_SIZE) * stride_kb + in_page * stride_kt + k_head_off
                v_dst = v_ptr + (slot // PAGE_SIZE) * stride_vb + in_page * stride_vt + v_head_off
                tl.store(k_dst + d[None, :] * stride_kd, key)
                tl.store(v_dst + d[None, :] * stride_vd, tl.load(new_v))
            tl.debug_barrier()  # the stores above are visible to the whole block's loads below
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        if SINGLE_TILE:
            if kv_start < kv_end:
                if WINDOW:
                    block_ids = _load_block_ids(table, kv_start, kv_end, BLOCK_N, PAGE_SIZE, True)
                acc, m_i, l_i = _attend_block(
                    acc, m_i, l_i, q, k_ptr, v_ptr, block_ids, kv_start, kv_end, rows, k_head_off,
                    v_head_off, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, qk_scale,
                    cap_scale, window, BLOCK_N, PAGE_SIZE, HEAD_DIM, D_PAD, True, False, False, SOFT_CAP,
                    DOT_PREC, DOT_FP32, KV_FP8,
                )  # fmt: skip
        else:
            acc, m_i, l_i = _attend_range(
                acc, m_i, l_i, q, k_ptr, v_ptr, table, kv_start, kv_start, kv_end, kv_end, rows,
                k_head_off, v_head_off, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                qk_scale, cap_scale, window, BLOCK_N, PAGE_SIZE, HEAD_DIM, D_PAD, False, False, SOFT_CAP,
                DOT_PREC, DOT_FP32, KV_FP8,
            )  # fmt: skip
        if KV_FP8:
            acc = acc * tl.load(v_scale_ptr)

        if SPLIT:
            # Partial rows: (grid row * num_q_heads + q_head) * num_splits + split, each D_PAD fp32,
            # then part_rows running maxima and part_rows denominators. A split past the context
            # stores the empty state (-inf, 0) and no accumulator: the merge reads none there.
            num_q_heads = tl.num_programs(1) * GROUP
            prow = (row.to(tl.int64) * num_q_heads + q_heads) * num_splits + split
            if kv_start < kv_end:
                tl.store(part_ptr + prow[:, None] * D_PAD + d[None, :], acc, mask=row_mask[:, None])
            tl.store(part_ptr + part_rows * D_PAD + prow, m_i, mask=row_mask)
            tl.store(part_ptr + part_rows * (D_PAD + 1) + prow, l_i, mask=row_mask)
        else:
            result = acc / l_i[:, None]
            o_rows = token.to(tl.int64) * stride_ot + q_heads[:, None] * stride_oh
            tl.store(
                out_ptr + o_rows + d[None, :] * stride_od, result.to(out_ptr.dtype.element_ty), mask=q_mask
            )


@triton.jit(do_not_specialize=["num_splits", "part_rows"])
def merge_kernel(
    out_ptr,
    part_ptr,
    cu_seqlens_q_ptr,
    num_splits,
    part_rows,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    BY_SEQ: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Merges the split partials of one grid row (as in `decode_kernel`) x one query head into its
    output row.

    A launch of its own rather than the last split program's job: the merge inside the split kernel,
    done by whichever program finished last (an atomic counter), cost several times what this
    launch does (README, Kernels). The partials were written by the
    previous launch, so ".cg" loads (L2) are as good as any. Split 0 always has keys, so the max is
    finite and the denominator positive.
    """
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    q_head = tl.program_id(1)
    token = row
    is_decode = True
    if BY_SEQ:
        token = tl.load(cu_seqlens_q_ptr + row).to(tl.int64)
        is_decode = tl.load(cu_seqlens_q_ptr + row + 1) - token == 1
    if is_decode:
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        live = s < num_splits
        prow = (row * tl.num_programs(1) + q_head) * num_splits + s
        m_ptrs = part_ptr + part_rows * D_PAD + prow
        m = tl.load(m_ptrs, mask=live, other=float("-inf"), cache_modifier=".cg")
        l_part = tl.load(m_ptrs + part_rows, mask=live, other=0.0, cache_modifier=".cg")
        acc_ptrs = part_ptr + prow[:, None] * D_PAD + d[None, :]
        filled = live & (m > float("-inf"))  # an empty split's accumulator is not even stored
        acc = tl.load(acc_ptrs, mask=filled[:, None], other=0.0, cache_modifier=".cg")
        weight = tl.math.exp2(m - tl.max(m, 0))
        result = tl.sum(acc * weight[:, None], 0) / tl.sum(weight * l_part, 0)
        o_ptrs = out_ptr + token * stride_ot + q_head * stride_oh + d * stride_od
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=[*_VARYING, "num_tiles", "window"])
def varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    cap_scale,
    window,
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
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Causal attention of BLOCK_Q new tokens x the G_PAD query heads of one KV head (one tile).

    Rows are token-major: row r is token r // G_PAD, query head r % G_PAD of the group. Key tiles
    that end at or before the tile's first position are visible to every row and run without masks;
    the rest (the diagonal, at most ceil(BLOCK_Q / BLOCK_N) + 1 tiles) run with the causal mask.
    Sequences with exactly one new token are skipped: `paged_attention` gives them to the decode
    kernel.
    WINDOW (a sliding window of `window` keys): the tile's keys start at the first one its earliest
    token can see (nothing before is loaded: those blocks may be freed or reused); key tiles that
    some of its later tokens cannot see carry the window's mask, and the others none (see
    `_attend_range`). SOFT_CAP: see `_attend_block`.
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    # Late tiles of a sequence have the most keys: hand them out first for a better tail.
    tile_slot = num_tiles - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    if SEQS_PAD > 0:
        seq, q_start, q_end, seq_len = _find_seq_vector(
            cu_seqlens_q_ptr, seq_lens_ptr, tile_slot, num_seqs, SEQS_PAD, BLOCK_Q
        )
    else:
        zero = tile_slot * 0
        seq = _find_seq(cu_seqlens_q_ptr, tile_slot, zero, zero + num_seqs - 1, BLOCK_Q, True)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
    q_len = q_end - q_start
    tile = tile_slot - (q_start // BLOCK_Q + seq)
    # Sequences of one new token are the decode kernel's (it runs beside this one on mixed batches).
    if (tile * BLOCK_Q < q_len) & (q_len != 1):
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
        if KV_FP8:
            if SOFT_CAP:
                cap_scale = cap_scale * tl.load(k_scale_ptr)
            else:
                qk_scale = qk_scale * tl.load(k_scale_ptr)
            if KV_FP8 == WIDEN_TO_F16:
                q = _q_to_f16(q)
        q_pos = cached + q_tok

        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        first_pos = cached + tile * BLOCK_Q
        kv_end = tl.minimum(cached + (tile + 1) * BLOCK_Q, seq_len)
        if WINDOW:
            kv_lo = tl.maximum(first_pos - window + 1, 0)  # the first key the tile's first token sees
            band_end = kv_end - window  # keys before this are out of the last token's window
        else:
            kv_lo = first_pos * 0
            band_end = kv_lo
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, k_ptr, v_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
            kv_lo, band_end, first_pos + 1, kv_end, q_pos,
            kv_head.to(tl.int64) * stride_kh, kv_head.to(tl.int64) * stride_vh,
            stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, qk_scale, cap_scale, window,
            BLOCK_N, PAGE_SIZE, HEAD_DIM, D_PAD, True, WINDOW, SOFT_CAP, DOT_PREC, DOT_FP32, KV_FP8,
        )  # fmt: skip
        if KV_FP8:
            acc = acc * tl.load(v_scale_ptr)

        result = acc / l_i[:, None]
        o_rows = (q_start + q_tok).to(tl.int64) * stride_ot + q_heads * stride_oh
        o_ptrs = out_ptr + o_rows[:, None] + d[None, :] * stride_od
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=q_mask)
