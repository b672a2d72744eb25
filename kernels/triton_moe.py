"""The routed experts of a mixture-of-experts MLP in Triton: vLLM's `fused_moe` design.

Contract: `kernels.reference.fused_moe` (same arguments, same result up to rounding).

Why a kernel: a per-expert loop in torch launches two matmuls per expert with a gather and a
scatter around them (128 experts: hundreds of launches, each too small to fill the GPU). Here
every (token, expert) assignment is one row of two grouped GEMMs:

1. `align` sorts the assignments by expert into blocks of BLOCK_M rows that each belong to one
   expert (`moe_align_block_size` in vLLM): an expert's rows are padded to a multiple of BLOCK_M
   with a sentinel id (= num_tokens * top_k), experts without a token get no block. Two small
   Triton kernels (a histogram per chunk of assignments, a scatter per chunk) with no host
   synchronisation, so CUDA graphs capture them; sizes are upper bounds from the shapes
   (`_max_sorted_rows`); the real count stays on the device and programs past it exit. (A torch
   version took two dozen launches, a radix sort among them.)
2. `_gate_up_kernel`: each program one block of BLOCK_M sorted rows x BLOCK_N columns of its
   expert's intermediate. It gathers the rows' tokens of x, multiplies them by the gate and the up
   rows of w13 at once (two accumulators) and writes silu(gate) * up, rounded to x's dtype (the
   reference's rounding point), at the assignment's row: the activation never makes a round trip
   through memory in [*, 2 * inter] form.
3. `_down_kernel`: the same over w2, each row times its routing weight, written at the
   assignment's row; then a sum over each token's top_k rows (`_sum_top_k_kernel`, accumulating
   in float32 in a fixed order) makes the output, as vLLM's `moe_sum` and SGLang's
   `moe_sum_reduce` do. The sum is a separate pass (one read of [tokens, top_k, hidden]) rather
   than atomics in the epilogue: it is deterministic and needs no zeroed float32 buffer.

Tile configs come from the number of assignment rows per expert (`choose_config`): small blocks
that spread the weight reads over many programs at decode sizes (memory bound: every expert's
weights are read once), big ones at prefill sizes (compute bound). Programs are ordered in groups
of GROUP_M row blocks per column block so that consecutive programs share weight tiles in L2.
Weight columns past the matrix wrap around (their outputs are masked at the store) and a reduction
that the tile divides (EVEN_K) loads without masks, as vLLM's kernel does.

FP8 weights (`--quantization fp8`): w13 / w2 in float8_e4m3fn with one float32 scale per output
row. Two ways to run them (`FP8_ACTIVATIONS_MIN_ROWS` picks by size):
* widened weights (W8A16): the e4m3 tiles are widened in registers to x's dtype (exact) and the
  products run in bf16; the scales multiply the accumulator's columns. Half the weight bytes of
  bf16, the reference's math. Kept for the smallest sizes: the widened tile goes back through
  shared memory before the tensor cores read it (Hopper's wgmma takes that operand from there),
  which costs more than the products at prefill sizes.
* FP8 activations (W8A8, the dense FP8 path's scheme, `kernels.fp8`): x and the intermediate are
  quantized per token (`kernels.fp8.quantize_per_token`) and the products run on FP8
  tensor cores at twice bf16's rate; the accumulator is scaled by the row's and the column's scale.

All offsets that multiply an index by a stride are 64-bit (experts x rows x hidden overflows
int32 for large models).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels import fp8

__all__ = ["MoeConfig", "align", "choose_config", "fused_moe"]

_FP8 = torch.float8_e4m3fn
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Read once: @triton.jit chose the interpreter or the compiler at import time as well.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Programs of a persistent launch (`MoeConfig.persistent`) under the interpreter: few, so that each
# loops over several tiles.
_INTERPRETED_PROGRAMS = 3
# FP8 weights run with FP8 activations from this many assignment rows (tokens x top_k) up, widened
# weights below (see the module docstring). The H200 run of 2026-12-02 (benchmarks/results/
# 2026-12-02-h200-s4) found FP8 activations faster at every size it timed, from 64 tokens at top-8
# (272 against 309 us) to 8,192 (1,458 against 2,594 us); smaller sizes, where two quantize launches
# weigh more against reading the weights, were not timed and keep widened weights.
FP8_ACTIVATIONS_MIN_ROWS = 512


@dataclass(frozen=True)
class MoeConfig:
    """Tile and launch parameters of one grouped GEMM: rows (assignments) x output columns x
    reduction per step, row blocks per column block in the launch order, warps, pipeline depth;
    tma_weights: weight tiles through a TMA descriptor instead of pointer loads (Hopper's copy
    engine; CUDA only, where the weights' strides allow it, else ignored): the prefill defaults'
    choice where the H200 sweep found it faster, a `benchmarks.moe --sweep` option elsewhere.
    persistent: one program per SM, each looping over tiles (in the same grouped order) instead of
    one program per tile of the bound; flatten: with persistent, Triton fuses the tile loop with the
    reduction loop, so a tile's first loads are issued during the previous tile's epilogue (the
    prologue and the epilogue are a large part of a 128-row tile whose reduction is 768 deep: 12
    steps of 64 in the down GEMM). `choose_config` says where they are the default; `benchmarks.moe
    --ab` times them against one program per tile. one_dot (gate_up only): the gate and up tiles
    multiplied as one operand of twice the width (`_gate_up_tile`)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma_weights: bool = False
    persistent: bool = False
    flatten: bool = False
    one_dot: bool = False


@functools.lru_cache(maxsize=256)
def choose_config(
    rows: int, num_experts: int, n: int, k: int, gate_up: bool, fp8_weights: bool = False,
    fp8_activations: bool = False,
) -> MoeConfig:  # fmt: skip
    """The tile config of one grouped GEMM from shapes only: `rows` assignments (tokens x top_k)
    over `num_experts`, n output columns (per half for the fused gate_up), k the reduction; FP8
    weights, widened or with FP8 activations.

    Decode and mid sizes are seeded from vLLM's H100 and H200 tables for 128 experts of width 768
    (at 64 tokens: 16 x 256 x 128, 8 warps; at 512: 64 x 128 x 64), the fused gate_up's two
    accumulators counted as one tile twice as wide; the H200 sweep of 2026-12-02
    (benchmarks/results/2026-12-02-h200-s4) kept them. Prefill sizes take the best of the H200
    sweeps at 8,192 tokens (benchmarks/results/2026-12-02-h200-s5): 128-row tiles; bf16 weights
    through TMA descriptors (gate_up 4 stages, down 256 columns); FP8 activations' gate_up 64
    columns per half with a 128-deep reduction, their down GEMM 128 x 128 x 128 through TMA (the
    largest tile without register spills: ptxas, sm_90); widened FP8 weights 64 gate_up columns per
    half, 4 stages. gate_up and down keep one block_m, so both run on one sorting of the assignments.
    The bf16 prefill down GEMM runs persistent and flattened: on an H100 (benchmarks.moe --ab,
    2026-12-05) its GEMM took 394.7 us against 438.7 one program per tile, the layer 1,365 us against
    1,423 in the same rounds; persistent gate_up variants were slower (255 registers: no headroom).
    The bf16 prefill gate_up multiplies gate and up as one product (one_dot): on an H100 (2026-12-05,
    second session) gate_up took 692.5 us against 748.0, the layer 0.717x of the dense anchor
    against 0.671x; 3 stages or 64 columns a half were slower, and at 512 tokens (memory bound) it
    made no difference, so the smaller sizes keep two products.
    """
    per_expert = rows / max(1, num_experts)
    half = 2 if gate_up else 1  # gate_up holds two accumulators of block_n columns
    if per_expert <= 8:
        cfg = MoeConfig(16, 256 // half, 128, 1, 8 if half == 1 else 4, 3)
    elif per_expert <= 48:
        cfg = MoeConfig(64, 128 // half, 64, 1, 4, 3)
    elif gate_up and fp8_activations:
        cfg = MoeConfig(128, 64, 128, 8, 8, 3)
    elif gate_up and fp8_weights:
        cfg = MoeConfig(128, 64, 64, 8, 8, 4)
    elif gate_up:
        cfg = MoeConfig(128, 128, 64, 8, 8, 4, tma_weights=True, one_dot=True)
    elif fp8_activations:
        cfg = MoeConfig(128, 128, 128, 8, 8, 3, tma_weights=True)
    elif fp8_weights:
        cfg = MoeConfig(128, 128, 64, 8, 8, 3, tma_weights=True)
    else:
        cfg = MoeConfig(128, 256, 64, 8, 8, 3, tma_weights=True, persistent=True, flatten=True)
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    return dataclasses.replace(cfg, block_n=block_n, block_k=block_k)


# --------------------------------------------------------------------------------------------- #
# Sorting assignments into expert blocks (two small Triton kernels, graph-capturable)
# --------------------------------------------------------------------------------------------- #

# Assignments per program of both sorting kernels at most (a power of two). At 8,192 tokens x top-8
# that is 128 programs each, one per SM of an H200. The scatter's loop over 128 of them is ~1,430
# instructions a warp (4 warps; SASS of triton 3.6 for sm_90), so a program takes ~4 x 1,430 x 4 / 4
# issue slots ~ 5.7K cycles, ~3 us: the whole scatter is ~2.9M warp instructions, against ~6.8M for
# the three kernels before it (1,672 a warp of 8 for each 128 assignments in the old scatter alone).
_ALIGN_CHUNK = 512
# ... and at least: one assignment per lane of the histogram at 4 warps (lanes holding copies of
# each other's elements make Triton divide the histogram by the copy count), and one step of the
# scatter's ranking.
_ALIGN_MIN_CHUNK = 128
# Programs that a chunk size between the two aims at: at decode sizes (512 assignments) 4 programs
# of 128 rather than one that ranks 4 x 128 and writes every expert's padding alone.
_ALIGN_PROGRAMS = 128
# The scatter ranks this many assignments at a time, each against the others ([128, 128] lanes).
_ALIGN_RANK = 128
# Rows of the [chunks, experts] count table that the scatter reads per step (128 rows at 8,192
# tokens: two steps).
_ALIGN_TABLE_ROWS = 64


def _max_sorted_rows(assignments: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded, sorted layout at most: every assignment, plus up to block_m - 1 padding
    rows for each expert that has any (at most min(experts, assignments) of them)."""
    return assignments + min(num_experts, assignments) * (block_m - 1)


@triton.jit
def _align_histogram_kernel(
    topk_ids_ptr, counts_ptr, assignments, CHUNK: tl.constexpr, EXPERTS: tl.constexpr
):
    """counts[chunk, e]: how many of this chunk's assignments go to expert e (EXPERTS >= 32 bins,
    a power of two, as Triton's warp histogram needs; bins past the experts stay 0)."""
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < assignments
    experts = tl.load(topk_ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    counts = tl.histogram(experts, EXPERTS, mask=valid)
    tl.store(counts_ptr + chunk * EXPERTS + tl.arange(0, EXPERTS), counts)


@triton.jit
def _align_scatter_kernel(
    topk_ids_ptr,
    counts_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_rows_ptr,
    assignments,
    num_chunks,
    num_experts,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    RANK: tl.constexpr,
    EXPERTS: tl.constexpr,
    TABLE_ROWS: tl.constexpr,
):
    """Each assignment of this chunk to its row: its expert's segment start (the earlier experts'
    totals, each rounded up to BLOCK_M) + the expert's assignments in earlier chunks (both from the
    whole [chunks, EXPERTS] count table, which every program reads: 128 x 128 ints at 8,192 tokens,
    less than a launch of a prefix sum costs) + those earlier in this chunk (token order within an
    expert), RANK assignments at a time. The first row of each block (always an assignment:
    padding only ends a segment) writes the block's expert; program c writes the padding rows (the
    sentinel) of experts c, c + chunks, ...; program 0 the number of rows."""
    chunk = tl.program_id(0)
    lanes_e = tl.arange(0, EXPERTS)
    totals = tl.zeros([EXPERTS], dtype=tl.int32)
    before = tl.zeros([EXPERTS], dtype=tl.int32)  # each expert's assignments in earlier chunks
    for c0 in range(0, num_chunks, TABLE_ROWS):
        table_chunks = c0 + tl.arange(0, TABLE_ROWS)
        table = tl.load(
            counts_ptr + table_chunks[:, None] * EXPERTS + lanes_e[None, :],
            mask=(table_chunks < num_chunks)[:, None],
            other=0,
        )
        totals += tl.sum(table, axis=0)
        before += tl.sum(tl.where((table_chunks < chunk)[:, None], table, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    next_rows = starts + before  # each expert's row for its next assignment in this chunk
    lanes = tl.arange(0, RANK)
    for r0 in range(0, CHUNK, RANK):
        offs = chunk * CHUNK + r0 + lanes
        valid = offs < assignments
        experts = tl.load(topk_ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
        earlier = (experts[:, None] == experts[None, :]) & (lanes[None, :] < lanes[:, None])
        base = tl.gather(next_rows, tl.where(valid, experts, 0), axis=0)
        rows = base + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_ids_ptr + rows, offs, mask=valid)
        # segment starts are multiples of BLOCK_M: a row that starts a block starts one of its expert's
        tl.store(block_experts_ptr + rows // BLOCK_M, experts, mask=valid & (rows % BLOCK_M == 0))
        next_rows += tl.histogram(experts, EXPERTS, mask=valid)
    if chunk == 0:
        tl.store(num_rows_ptr, tl.sum(padded, axis=0))
    if BLOCK_M > 1:
        pad_lanes = tl.arange(0, BLOCK_M)
        for e in range(chunk, num_experts, num_chunks):
            total = tl.sum(tl.where(lanes_e == e, totals, 0), axis=0)
            segment = tl.sum(tl.where(lanes_e == e, starts, 0), axis=0)
            pads = total + pad_lanes  # rows of e's segment past its assignments
            end = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            tl.store(sorted_ids_ptr + segment + pads, tl.zeros_like(pads) + assignments, mask=pads < end)


def _align_chunk(assignments: int) -> int:
    per_program = triton.next_power_of_2(triton.cdiv(max(1, assignments), _ALIGN_PROGRAMS))
    return max(_ALIGN_MIN_CHUNK, min(_ALIGN_CHUNK, per_program))


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Assignments sorted by expert and padded into blocks of block_m rows of one expert.

    Two launches (a histogram per chunk of assignments, then a scatter per chunk), no host
    synchronisation; the sizes are bounds from the shapes (`_max_sorted_rows`) and the real row
    count stays on the device, where the GEMM programs past it exit before reading anything. The
    three launches before (a count per chunk of 128, a prefix sum per expert over the chunks, a
    scatter per chunk of 128) took 25-49 us at 8,192 tokens on the H200 (benchmarks/results/
    2026-12-03-h200*, 2026-12-04-h200), mostly launches and chains of dependent loads: their math
    is ~2M warp instructions, ~2 us spread over the GPU. Here the count is Triton's warp histogram
    and each scatter program redoes the prefix sum from the 128 x 128 table, which costs less than a
    launch; the scatter ranks 128 assignments at a time as before. On an H100 (benchmarks.moe --ab,
    2026-12-05) the two launches took 17.5 us at 8,192 tokens.

    Returns:
        sorted_ids: [max rows] int32, assignment indices (token * top_k + slot), grouped by expert
            (ascending experts, token order within one), each expert's group padded to a multiple
            of block_m with the sentinel num_tokens * top_k; entries past num_rows are unspecified.
        block_experts: [cdiv(max rows, block_m)] int32, each block's expert (unspecified past
            num_rows // block_m).
        num_rows: [1] int32, the real number of padded rows (a multiple of block_m).
    """
    flat = topk_ids.reshape(-1)
    assignments = flat.numel()
    device = flat.device
    max_rows = _max_sorted_rows(assignments, num_experts, block_m)
    chunk = _align_chunk(assignments)
    chunks = max(1, triton.cdiv(assignments, chunk))
    experts = max(32, triton.next_power_of_2(num_experts))  # histogram bins: >= a warp's lanes
    counts = torch.empty((chunks, experts), dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max(1, max_rows), dtype=torch.int32, device=device)
    block_experts = torch.empty(max(1, triton.cdiv(max_rows, block_m)), dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int32, device=device)
    _align_histogram_kernel[(chunks,)](flat, counts, assignments, CHUNK=chunk, EXPERTS=experts, num_warps=4)
    table_rows = min(_ALIGN_TABLE_ROWS, triton.next_power_of_2(chunks))
    _align_scatter_kernel[(chunks,)](
        flat, counts, sorted_ids, block_experts, num_rows, assignments, chunks, num_experts,
        BLOCK_M=block_m, CHUNK=chunk, RANK=min(_ALIGN_RANK, chunk), EXPERTS=experts, TABLE_ROWS=table_rows,
        num_warps=4,
    )  # fmt: skip
    return sorted_ids, block_experts, num_rows


# --------------------------------------------------------------------------------------------- #
# Device code
# --------------------------------------------------------------------------------------------- #


@triton.jit
def _grouped_tile(tile, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    """(row block, column block) of launch-order tile number `tile`: GROUP_M row blocks per column
    block, so that consecutive tiles share weight tiles in L2."""
    in_group = GROUP_M * blocks_n
    first_m = (tile // in_group) * GROUP_M
    group_size = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_size
    pid_n = (tile % in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _program_tile(
    num_rows_ptr, max_rows, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr
):
    """(row block, column block) of this program in grouped order, and whether it has rows."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(max_rows, BLOCK_M), tl.cdiv(n, BLOCK_N), GROUP_M)
    live = pid_m * BLOCK_M < tl.load(num_rows_ptr)
    return pid_m, pid_n, live


@triton.jit
def _dot_operand(t, out_ptr, WIDEN: tl.constexpr, DOT_FP32: tl.constexpr):
    """A tile as tl.dot takes it: float32 with DOT_FP32; widened from e4m3 to the output's dtype
    with WIDEN; else as loaded."""
    if DOT_FP32:
        return t.to(tl.float32)
    elif WIDEN:
        return t.to(out_ptr.dtype.element_ty)
    else:
        return t


@triton.jit
def _gate_up_tile(
    pid_m,
    pid_n,
    a_ptr,
    w_ptr,
    w_desc,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    assignments,
    inter,
    hidden,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    W_FP8: tl.constexpr,
    A_FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """One tile of `_gate_up_kernel` (row block pid_m, column block pid_n). ONE_DOT: the gate and
    the up tile as one [BLOCK_K, 2 * BLOCK_N] operand of one product (one wgmma of twice the width,
    which reads the activation tile from shared memory once instead of twice); otherwise two."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    valid = ids < assignments
    tokens = tl.where(valid, ids // TOP_K, 0).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    w_n = (offs_n % inter).to(tl.int64)  # the tail's columns wrap: weight loads need no mask
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tokens[:, None] * stride_am + offs_k[None, :] * stride_ak
    g_ptrs = w_ptr + expert * stride_we + w_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + inter * stride_wn
    # ONE_DOT's operand: column j < BLOCK_N is gate row w_n[j], column BLOCK_N + j up row inter + w_n[j]
    gu_n = tl.join(w_n, w_n + inter).permute(1, 0).reshape(2 * BLOCK_N)
    gu_ptrs = w_ptr + expert * stride_we + gu_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    WIDEN: tl.constexpr = W_FP8 and not A_FP8  # e4m3 weights widened to x's dtype: exact
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        a = _dot_operand(a, out_ptr, False, DOT_FP32)
        if ONE_DOT:
            if W_TMA:  # w_desc: a [1, 2, BLOCK_N, BLOCK_K] box of w13 seen as [E, 2, inter, hidden]
                gu = w_desc.load([expert.to(tl.int32), 0, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
            elif EVEN_K:
                gu = tl.load(gu_ptrs)
            else:
                gu = tl.load(gu_ptrs, mask=k_mask[:, None], other=0.0)
            gu = _dot_operand(gu, out_ptr, WIDEN, DOT_FP32)
            acc = tl.dot(a, gu, acc=acc, input_precision=DOT_PREC)
        else:
            if W_TMA:
                g = w_desc.load([expert.to(tl.int32), n0, k0]).reshape(BLOCK_N, BLOCK_K).T
                u = w_desc.load([expert.to(tl.int32), inter + n0, k0]).reshape(BLOCK_N, BLOCK_K).T
            elif EVEN_K:
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                g = tl.load(g_ptrs, mask=k_mask[:, None], other=0.0)
                u = tl.load(u_ptrs, mask=k_mask[:, None], other=0.0)
            g = _dot_operand(g, out_ptr, WIDEN, DOT_FP32)
            u = _dot_operand(u, out_ptr, WIDEN, DOT_FP32)
            acc_g = tl.dot(a, g, acc=acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(a, u, acc=acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
        gu_ptrs += BLOCK_K * stride_wk
    if ONE_DOT:  # column j and BLOCK_N + j: the same thread's registers in the MMA layout
        acc_g, acc_u = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1))
    if W_FP8:
        s_ptrs = w_scale_ptr + expert * stride_se + w_n * stride_sn
        acc_g *= tl.load(s_ptrs)[None, :]
        acc_u *= tl.load(s_ptrs + inter * stride_sn)[None, :]
    if A_FP8:
        row_scale = tl.load(a_scale_ptr + tokens, mask=valid, other=0.0)[:, None]
        acc_g *= row_scale
        acc_u *= row_scale
    hidden_act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    o_ptrs = out_ptr + ids.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, hidden_act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["max_rows", "assignments"])
def _gate_up_kernel(
    a_ptr,
    w_ptr,
    w_desc,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_rows_ptr,
    max_rows,
    assignments,
    inter,
    hidden,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    W_FP8: tl.constexpr,
    A_FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """silu(x w_gate^T) * (x w_up^T) for BLOCK_M sorted assignment rows (one expert) x BLOCK_N
    intermediate columns, written in the output dtype at the assignments' rows.

    a: x [tokens, hidden] (or its FP8 quantization with A_FP8: a_scale [tokens] per token); row r
    of the block reads token sorted_ids[r] // TOP_K. w: w13 [experts, 2 * inter, hidden]; gate
    rows n, up rows inter + n. W_FP8: e4m3 weights with w_scale [experts, 2 * inter] per row,
    widened to x's dtype unless A_FP8 (then both operands are e4m3). W_TMA: w13's tiles come
    through w_desc (a [1, BLOCK_N, BLOCK_K] descriptor of w13, with ONE_DOT [1, 2, BLOCK_N,
    BLOCK_K] of w13 seen as [E, 2, inter, hidden]; rows past the end read zeros). ONE_DOT: see
    `_gate_up_tile`.
    PERSISTENT: each program loops over the real tiles (num_rows' row blocks, no program for the
    bound's empty ones) in the same grouped order, num_programs apart; FLATTEN lets Triton fuse
    that loop with the reduction's so the next tile's first loads are in flight during this one's
    epilogue (`tl.range(flatten=True)`). Otherwise one tile per program.
    """
    if PERSISTENT:
        blocks_m = tl.load(num_rows_ptr) // BLOCK_M
        blocks_n = tl.cdiv(inter, BLOCK_N)
        for tile in tl.range(tl.program_id(0), blocks_m * blocks_n, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = _grouped_tile(tile, blocks_m, blocks_n, GROUP_M)
            _gate_up_tile(
                pid_m, pid_n, a_ptr, w_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, sorted_ids_ptr,
                block_experts_ptr, assignments, inter, hidden, stride_am, stride_ak, stride_we, stride_wn,
                stride_wk, stride_om, stride_on, stride_se, stride_sn, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K,
                EVEN_K, W_TMA, W_FP8, A_FP8, DOT_FP32, DOT_PREC, ONE_DOT,
            )  # fmt: skip
    else:
        pid_m, pid_n, live = _program_tile(num_rows_ptr, max_rows, inter, BLOCK_M, BLOCK_N, GROUP_M)
        if live:
            _gate_up_tile(
                pid_m, pid_n, a_ptr, w_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, sorted_ids_ptr,
                block_experts_ptr, assignments, inter, hidden, stride_am, stride_ak, stride_we, stride_wn,
                stride_wk, stride_om, stride_on, stride_se, stride_sn, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K,
                EVEN_K, W_TMA, W_FP8, A_FP8, DOT_FP32, DOT_PREC, ONE_DOT,
            )  # fmt: skip


@triton.jit
def _down_tile(
    pid_m,
    pid_n,
    a_ptr,
    w_ptr,
    w_desc,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    assignments,
    hidden,
    inter,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    W_FP8: tl.constexpr,
    A_FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One tile of `_down_kernel` (row block pid_m, column block pid_n)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    valid = ids < assignments
    rows = tl.where(valid, ids, 0).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    w_n = (offs_n % hidden).to(tl.int64)  # as in `_gate_up_tile`
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + w_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < inter - k0)[None, :], other=0.0)
        if W_TMA:
            w = w_desc.load([expert.to(tl.int32), pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(offs_k < inter - k0)[:, None], other=0.0)
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        elif W_FP8 and not A_FP8:
            w = w.to(out_ptr.dtype.element_ty)
        acc = tl.dot(a, w, acc=acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if W_FP8:
        acc *= tl.load(w_scale_ptr + expert * stride_se + w_n * stride_sn)[None, :]
    if A_FP8:
        acc *= tl.load(a_scale_ptr + rows, mask=valid, other=0.0)[:, None]
    acc *= tl.load(topk_weights_ptr + rows, mask=valid, other=0.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["max_rows", "assignments"])
def _down_kernel(
    a_ptr,
    w_ptr,
    w_desc,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_rows_ptr,
    max_rows,
    assignments,
    hidden,
    inter,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    W_FP8: tl.constexpr,
    A_FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """(h w_down^T) * routing weight for BLOCK_M sorted assignment rows x BLOCK_N hidden columns,
    written at the assignments' rows of out [tokens * top_k, hidden].

    a: the intermediate h [tokens * top_k, inter] (row = assignment; A_FP8: its per-row FP8
    quantization with a_scale [tokens * top_k]); w: w2 [experts, hidden, inter]; W_FP8 as in
    `_gate_up_kernel`; topk_weights: [tokens * top_k] float32; W_TMA: w2's tiles through w_desc;
    PERSISTENT and FLATTEN as in `_gate_up_kernel`.
    """
    if PERSISTENT:
        blocks_m = tl.load(num_rows_ptr) // BLOCK_M
        blocks_n = tl.cdiv(hidden, BLOCK_N)
        for tile in tl.range(tl.program_id(0), blocks_m * blocks_n, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n = _grouped_tile(tile, blocks_m, blocks_n, GROUP_M)
            _down_tile(
                pid_m, pid_n, a_ptr, w_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, topk_weights_ptr,
                sorted_ids_ptr, block_experts_ptr, assignments, hidden, inter, stride_am, stride_ak,
                stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_se, stride_sn, BLOCK_M,
                BLOCK_N, BLOCK_K, EVEN_K, W_TMA, W_FP8, A_FP8, DOT_FP32, DOT_PREC,
            )  # fmt: skip
    else:
        pid_m, pid_n, live = _program_tile(num_rows_ptr, max_rows, hidden, BLOCK_M, BLOCK_N, GROUP_M)
        if live:
            _down_tile(
                pid_m, pid_n, a_ptr, w_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, topk_weights_ptr,
                sorted_ids_ptr, block_experts_ptr, assignments, hidden, inter, stride_am, stride_ak,
                stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_se, stride_sn, BLOCK_M,
                BLOCK_N, BLOCK_K, EVEN_K, W_TMA, W_FP8, A_FP8, DOT_FP32, DOT_PREC,
            )  # fmt: skip


@triton.jit
def _sum_top_k_kernel(rows_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, :] = sum over k of rows[t * TOP_K + k, :] (float32 accumulation, k in order) for one
    token t and BLOCK_H columns: one read of the down GEMM's rows at streaming speed (torch's
    generic reduction over the middle dimension ran ~1.6x slower on the H200)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (token * TOP_K + k) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_top_k(rows: torch.Tensor, out: torch.Tensor, top_k: int) -> torch.Tensor:
    """out [tokens, hidden] = rows [tokens * top_k, hidden] summed over each token's top_k rows."""
    num_tokens, hidden = out.shape
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_top_k_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        rows, out, hidden, TOP_K=top_k, BLOCK_H=block_h, num_warps=4
    )
    return out


# --------------------------------------------------------------------------------------------- #
# Python entry point
# --------------------------------------------------------------------------------------------- #


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs, and every dtype under the interpreter, whose tl.dot multiplies bf16's raw
    uint16 bits (see `triton_attention._dot_in_fp32`) and has no FP8 products."""
    return dtype == torch.float32 or _INTERPRETED


def _uses_tma(w: torch.Tensor, cfg: MoeConfig) -> bool:
    """Whether cfg's weight tiles can come through a TMA descriptor of w: asked for, a CUDA (or
    interpreted) tensor, 16-byte aligned base and strides."""
    if not cfg.tma_weights or not (w.is_cuda or _INTERPRETED):
        return False
    size = w.element_size()
    return w.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in w.stride()[:2])


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(cfg: MoeConfig, max_rows: int, n: int, device: torch.device) -> tuple[int]:
    """One program per tile of the bound (max_rows x n), or with cfg.persistent one per SM (at most
    one per tile); the interpreter takes `_INTERPRETED_PROGRAMS`, so that each loops over several
    tiles in the tests."""
    tiles = triton.cdiv(max_rows, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if not cfg.persistent:
        return (tiles,)
    programs = _sm_count(device.index) if device.type == "cuda" else _INTERPRETED_PROGRAMS
    return (max(1, min(tiles, programs)),)


def _weight_descriptor(w: torch.Tensor, cfg: MoeConfig, halves: bool = False):
    """A [1, block_n, block_k] TMA descriptor of the stacked weights w [experts, rows, cols], or
    None (pointer loads); halves: [1, 2, block_n, block_k] of w seen as [experts, 2, rows / 2, cols]
    (gate_up's one_dot: a gate tile and its up tile in one box)."""
    if not _uses_tma(w, cfg):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    if halves:
        w = w.unflatten(1, (2, w.shape[1] // 2))
        return TensorDescriptor(w, list(w.shape), list(w.stride()), [1, 2, cfg.block_n, cfg.block_k])
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [1, cfg.block_n, cfg.block_k])


def _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale) -> None:
    assert x.dim() == 2 and x.dtype in _SUPPORTED_DTYPES, "x must be [num_tokens, hidden] bf16/fp16/fp32"
    assert w13.dim() == 3 and w2.dim() == 3, "w13: [experts, 2 * inter, hidden], w2: [experts, hidden, inter]"
    num_experts, two_inter, hidden = w13.shape
    assert two_inter % 2 == 0 and hidden == x.shape[1], "w13 must be [experts, 2 * inter, hidden]"
    assert w2.shape == (num_experts, hidden, two_inter // 2), "w2 must be [experts, hidden, inter]"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0]
    assert not topk_ids.is_floating_point() and topk_weights.dtype == torch.float32
    fp8 = w13.dtype == _FP8
    assert w2.dtype == w13.dtype and (fp8 or w13.dtype == x.dtype), "weights: x's dtype or both e4m3"
    assert (w13_scale is not None) == fp8 and (w2_scale is not None) == fp8, "scales iff e4m3 weights"
    if fp8:
        assert w13_scale.shape == (num_experts, two_inter) and w2_scale.shape == (num_experts, hidden)
        assert w13_scale.dtype == w2_scale.dtype == torch.float32
    for t in (w13, w2, topk_weights, topk_ids, w13_scale, w2_scale):
        assert t is None or t.device == x.device, "all tensors must be on one device"
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "weights must be contiguous along their last dim"


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    fp8_activations: bool | None = None,
    gate_up_config: MoeConfig | None = None,
    down_config: MoeConfig | None = None,
) -> torch.Tensor:
    """The routed experts; see `kernels.reference.fused_moe`.

    The keyword-only arguments override the shape-based choices (tests, tuning): FP8 activations
    or widened FP8 weights, and each GEMM's tile config.
    """
    _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    rows = num_tokens * top_k
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    w_fp8 = w13.dtype == _FP8
    if fp8_activations is None:
        fp8_activations = w_fp8 and rows >= FP8_ACTIVATIONS_MIN_ROWS
    a_fp8 = w_fp8 and fp8_activations
    gate_up_config = gate_up_config or choose_config(rows, num_experts, inter, hidden, True, w_fp8, a_fp8)
    down_config = down_config or choose_config(rows, num_experts, hidden, inter, False, w_fp8, a_fp8)
    dot_fp32 = _dot_in_fp32(x.dtype)
    precision = "ieee" if dot_fp32 else "tf32"
    x = x if x.stride(1) == 1 else x.contiguous()
    flat_weights = topk_weights.reshape(-1).contiguous()

    hidden_act = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    a, a_scale = x, x  # a_scale is never read without A_FP8
    if a_fp8:  # per token, as the dense FP8 path (Triton on CUDA; the interpreter's e4m3 rounding
        # is off by a binade at times, so CPU tensors take the reference: `kernels.fp8`)
        a, a_scale = fp8.quantize_per_token(x)
    sorted_ids, block_experts, num_rows = align(topk_ids, num_experts, gate_up_config.block_m)
    cfg = gate_up_config
    max_rows = sorted_ids.shape[0]
    _gate_up_kernel[_grid(cfg, max_rows, inter, x.device)](
        a, w13, _weight_descriptor(w13, cfg, halves=cfg.one_dot), hidden_act, a_scale,
        w13_scale if w_fp8 else w13, sorted_ids, block_experts, num_rows, max_rows, rows, inter, hidden,
        *a.stride(), *w13.stride(), *hidden_act.stride(), *(w13_scale.stride() if w_fp8 else (0, 0)),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=hidden % cfg.block_k == 0, W_TMA=_uses_tma(w13, cfg), W_FP8=w_fp8, A_FP8=a_fp8,
        DOT_FP32=dot_fp32, DOT_PREC=precision,
        PERSISTENT=cfg.persistent, FLATTEN=cfg.persistent and cfg.flatten, ONE_DOT=cfg.one_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip

    cfg = down_config
    if cfg.block_m != gate_up_config.block_m:
        sorted_ids, block_experts, num_rows = align(topk_ids, num_experts, cfg.block_m)
        max_rows = sorted_ids.shape[0]
    h, h_scale = hidden_act, hidden_act
    if a_fp8:
        h, h_scale = fp8.quantize_per_token(hidden_act)
    # top_k rows per token, summed below; with one row per token the kernel writes the output
    down = out if top_k == 1 else torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[_grid(cfg, max_rows, hidden, x.device)](
        h, w2, _weight_descriptor(w2, cfg), down, h_scale, w2_scale if w_fp8 else w2, flat_weights,
        sorted_ids, block_experts, num_rows, max_rows, rows, hidden, inter, *h.stride(), *w2.stride(),
        *down.stride(), *(w2_scale.stride() if w_fp8 else (0, 0)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=inter % cfg.block_k == 0, W_TMA=_uses_tma(w2, cfg), W_FP8=w_fp8, A_FP8=a_fp8,
        DOT_FP32=dot_fp32, DOT_PREC=precision,
        PERSISTENT=cfg.persistent, FLATTEN=cfg.persistent and cfg.flatten,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if top_k > 1:
        sum_top_k(down, out, top_k)
    return out
