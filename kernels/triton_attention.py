"""Triton paged attention and KV writes: the entry points and every launch decision.

Contract: see `kernels.reference` (same arguments, same results up to rounding). The device code
(the @triton.jit kernels) is in `kernels.attention_jit`; this module picks the kernel, its grid and
its meta-parameters from shapes, owns the split-KV scratch, and launches.

Kernel choice, by shape only
----------------------------
Launch parameters never come from tensor *values* (no `.item()`, `.tolist()` or `max(seq_lens)` on
the host), so a decode step can be captured in a CUDA graph. Which kernel runs and how big its grid
is depend only on shapes: `num_tokens = q.shape[0]`, `num_seqs = seq_lens.shape[0]`,
`max_blocks_per_seq = block_tables.shape[1]` and the head counts. The constants of a launch are
worked out once per shape (`_decode_plan`, `choose_prefill_config`, `_varlen_meta`, cached), which
keeps an eager call cheap.

* `num_tokens == num_seqs` (every sequence has one new token in the usual case: a decode batch):
  the split-KV *decode* kernel. Its grid is (token, KV head, split). One program handles all query
  heads that share a KV head (GQA), so each KV block is read once per KV head; its query rows are
  padded to a power of two >= 16 so the products run on `tl.dot`. When tokens x KV heads alone
  cannot fill the GPU, the context is cut into `num_splits` partitions (flash-decoding): each
  program stores its partial result (unnormalised sum, running max, denominator) and a second,
  small launch (`merge_kernel`, one program per grid row and query head) combines them. The merge
  once ran inside the split launch, done by the last program to finish (an atomic counter), which
  saved a launch but cost far more at small batches (the README's Kernels section). When the
  whole context fits one key tile per program in one wave (small batches), each program holds
  exactly one tile and loads that tile's block ids together with the sequence length, saving a
  round trip to memory. Otherwise the split count is planned for the longest context the block
  table holds (a CUDA graph fixes it at capture), and each token spreads its own context over the
  splits (`FIT_SPLITS`): a short context takes as many splits as it has key tiles, instead of a
  few splits of several tiles each. The kernel finds each token's sequence itself, and each token
  attends causally up to its own position, so the result stays correct even if
  `num_tokens == num_seqs` hides a sequence with two new tokens next to one with none.
* otherwise, a mixed batch (prefill chunks, whole prompts and decodes in any order): both kernels.
  The decode kernel runs with one grid row per *sequence* (`BY_SEQ`): the rows of sequences with
  exactly one new token do the work above, the others exit at once. The *varlen* kernel, launched
  after it, takes the other sequences (it always leaves single-token ones to the decode kernel).
  Run through the varlen kernel, a decode would cost a whole query tile of mostly padding (the
  README's Executor steps section measures the difference). The varlen grid is (virtual query
  tile, KV head). Sequence i owns the tile slots starting at `cu_seqlens_q[i] // BLOCK_Q + i`;
  that start is increasing in i and leaves each sequence at least
  `ceil(q_len_i / BLOCK_Q)` slots, so `num_tokens // BLOCK_Q + num_seqs` slots always suffice, and a
  program finds its sequence from `cu_seqlens_q` (one vector load and a count for up to 1024
  sequences, a binary search beyond). Slots past a sequence's last tile exit at once. A tile holds
  BLOCK_Q tokens times the (padded) query heads of one KV head group, so here too each KV block is
  read once per KV head and tile. Key tiles before the query tile's first position are visible to
  every row and run without any mask; only the diagonal tiles carry the causal and length masks.
  Batches with many new tokens take tiles four times as tall (`big_prefill_config`): fewer reads
  of each key tile, but fewer programs, so only where they still fill the GPU several times.

Split-KV scratch
----------------
The partial results (fp32) live in one scratch buffer per device, allocated on first use and
grown (never shrunk) as shapes need. A buffer that is outgrown is kept alive, because CUDA graphs
captured earlier still point at it. The scratch is shared by all decode launches on a device, so
they must run one after another (one stream, as the executor does). A graph captured before any
eager call of a large enough shape gets a buffer of its own from the graph's pool: warm up eagerly
before capturing.

FP8 caches
----------
Caches of float8_e4m3fn (`--kv-cache-dtype fp8`) go through the same kernels with `KV_FP8`: K/V
tiles are loaded as bytes (half the traffic), widened in registers, and the per-layer scales are
read from device memory once per program: k_scale folds into the softmax scale, v_scale multiplies
the accumulator before it is stored (or stored as a split partial); no element is multiplied by a
scale. `write_kv` quantizes. The decode kernel widens to float16 (one instruction per two values;
q is cast to float16 once per program) with V through an opaque conversion, so that V's tile is not
read byte by byte from shared memory in the dot-operand layout (`attention_jit._widen_v_e4m3`); the
varlen kernel casts to q's dtype, which measured faster there (`FP8_DECODE_WIDEN`,
`FP8_PREFILL_WIDEN`). Launch choices are the bf16 ones: in two H200 sweeps no other decode config
was faster with FP8 caches at the large K1 shapes, and none consistently at the small ones.

Decodes over FP8 caches run the CUDA kernel of `kernels.cuda_decode` instead of the Triton decode
kernel wherever its shapes apply (`FP8_DECODE_CUDA`): the same arguments, the same split partials
and merge, its own split count (each of its warps reads one KV head with its own loads in flight,
so 8 of them per SM suffice). Every Triton decode loop tried read FP8 bytes at <= 0.74x of the bf16
kernel's rate; the CUDA kernel reads them at 0.92-0.97x at the large K1 shapes (README, FP8).

Sliding windows and soft-caps
-----------------------------
A layer's sliding window (Mistral; Gemma's local layers) and attention soft-cap (Gemma 2) are
launch arguments, with one constexpr flag each (`WINDOW`, `SOFT_CAP`): a model compiles at most
one variant per flag combination it uses (2 for Gemma's local/global layers), not one per window
size, and a CUDA graph captures the values as any other argument. An executor's warm-up forward
runs every layer, so every variant is compiled before graphs are captured.
No key before a query's window is loaded: the scheduler frees blocks that fall out of the window
and another sequence may own them (NaN or inf there would survive any mask as 0 * NaN). The
decode kernel starts each token's splits at its window's first key and splits the window, not the
table (`_decode_plan`: a (64, 4096) decode with a 1024-key window is launched as a (64, 1024) one);
each varlen tile starts at the first key its earliest token sees, masks the window only in the key
tiles at the window's lower edge and runs the tiles every row sees without a mask. A window at
least as long as the block table can exclude nothing, and is dropped (`binding_window`, shapes
only). The soft-cap is a tanh on the scores (`attention_jit._tanh`).
The CUDA FP8 decode kernel has neither: windowed or capped layers over FP8 caches decode on the
Triton FP8 kernel. That costs bandwidth only where the CUDA kernel applies at all (head_dim 128:
Mistral, Gemma-2/3-27B; Gemma's other sizes have head_dim 256), and a windowed decode reads at most
`window` keys per sequence, so those layers are a small part of a long-context step; the global
layers keep the CUDA kernel.

All pointer offsets into the caches are computed in 64 bits (block ids are cast to int64 before
they meet a stride), so pools of more than 2^15 blocks of any size are safe.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.kernels import cuda_decode
from pagedserve.kernels.attention_jit import (
    WIDEN_TO_F16,
    WIDEN_TO_Q_DTYPE,
    decode_kernel,
    merge_kernel,
    rotary_write_kv_kernel,
    varlen_kernel,
    write_kv_kernel,
)
from pagedserve.kernels.pdl import launch_args as pdl_launch_args
from pagedserve.kernels.triton_layers import RotaryLaunch, check_rotary

__all__ = [
    "paged_attention",
    "rotary_paged_attention",
    "rotary_write_kv",
    "write_kv",
    "DecodeConfig",
    "PrefillConfig",
    "ScoreOptions",
]

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = torch.float8_e4m3fn
# Read once: @triton.jit chose the interpreter or the compiler at import time as well.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# How each kernel widens FP8 K/V tiles (`attention_jit.WIDEN_*`), measured on the H200 (README,
# FP8; `python -m benchmarks.fp8 --parts decode,sweep,sweep-prefill`): float16 with V through
# the opaque conversion made the decode kernel 1.45-2.1x faster than casts to bf16 from 8 sequences
# up (about equal at one), but not the varlen kernel (fresh prompts at 0.69x of bf16's speed against
# 0.82x with the casts); the interpreter has no inline asm.
FP8_DECODE_WIDEN = WIDEN_TO_Q_DTYPE.value if _INTERPRETED else WIDEN_TO_F16.value
FP8_PREFILL_WIDEN = WIDEN_TO_Q_DTYPE.value
# FP8 decodes run the CUDA kernel (`kernels.cuda_decode`) with this config where it applies, the
# Triton decode kernel where not (or with None: `PAGEDSERVE_FP8_DECODE=triton`, for comparisons).
FP8_DECODE_CUDA: cuda_decode.CudaDecodeConfig | None = (
    None if os.environ.get("PAGEDSERVE_FP8_DECODE") == "triton" else cuda_decode.default_config()
)
# Each warp of the CUDA kernel keeps its own loads in flight over one KV head of one split, so 8
# such warps per SM already read at full speed, and more splits only add merge work (H200, bytes/s
# over bf16's: (64, 4096) 0.88 / 0.96 / 0.92 with 1 / 2 (chosen) / 4 splits; (32, 16384) 0.87 /
# 0.97 with 2 / 4 (chosen); at small batches 0.5-4x the chosen count is nowhere 1% faster).
_CUDA_HEADS_PER_SM = 8
# Split-KV policy. With the default decode config 4 programs fit on an SM at once (by ptxas for
# sm_90). Decode programs of one launch are equally long, so the launch is as fast as its fullest
# wave: the split count is the smallest that fills the resident slots to _WAVE_EFFICIENCY (a
# partial last wave measurably slows K1's (32, 16384): `--sweep`). Batches that already
# fill two waves are not split.
_RESIDENT_PROGRAMS_PER_SM = 4
_WAVE_EFFICIENCY = 0.9
# A split shorter than this many tokens costs more in the merge than it wins in parallelism...
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 64
# ...unless one key tile per program covers the whole context in one wave of `single_tile_decode_config`
# programs (2 fit on an SM: 8 warps x 119-128 registers by ptxas for sm_90): then the launch moves
# few bytes per program and is bound by its chain of dependent memory accesses, which one tile per
# program shortens (see `attention_jit.decode_kernel`).
_SINGLE_TILE_PROGRAMS_PER_SM = 2
# Looping splits partition each token's own context (`decode_kernel`'s FIT_SPLITS), not the
# table's, whose full width a CUDA graph's launch is planned for. `PAGEDSERVE_DECODE_SPLITS=table`
# turns that off, for comparisons.
FIT_SPLITS = os.environ.get("PAGEDSERVE_DECODE_SPLITS", "context") != "table"
# The merge loads all splits of one query head at once: at most this many fp32 per thread.
_MERGE_ELEMENTS_PER_THREAD = 128
# The varlen kernel finds its sequence with one vector load up to this many sequences, by binary
# search beyond.
_MAX_VECTOR_SEQS = 1024
_SEQS_PAD_BUCKETS = (64, 256, _MAX_VECTOR_SEQS)
# Big prefill tiles need this many waves of programs (one per SM) to beat the default ones: they
# tie at about 4 and win beyond (`python -m benchmarks.kernels --sweep`; README, Kernels).
_BIG_PREFILL_MIN_WAVES = 4


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
    ptxas for sm_90: no spills). For bf16/fp16 `python -m benchmarks.kernels --sweep` picked
    (64 keys, 4 warps, 2 stages) at every K1 shape from (8, 4096) to (32, 16384); 3 stages ran
    slower at all of them (the figures: README, Kernels). More stages add no K/V buffer in this
    loop (its addresses come from block ids loaded in the same iteration); loading the ids a tile
    ahead so that they do measured no faster, in bf16 or FP8 (README, FP8).
    """
    if dtype == torch.float32:
        return DecodeConfig(block_n=32, num_warps=8, num_stages=2)
    if head_dim_pad >= 256:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=2)


def default_prefill_config(head_dim_pad: int, dtype: torch.dtype) -> PrefillConfig:
    """Prefill is matrix-bound: big tiles for 2-byte types, smaller ones where registers run short.

    fp32 runs its products exactly (no tensor cores) and is a correctness path, not a fast one. Its
    32-row tile takes 8 warps: with 4, ptxas (sm_90, Triton 3.7) gave it 188 registers, and 255 with
    764 bytes of spills in the sliding-window variant; with 8, 73-78 and no spills in either.
    """
    if dtype == torch.float32:
        if head_dim_pad >= 256:
            return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
        return PrefillConfig(block_m=32, block_n=16, num_warps=8, num_stages=2)
    if head_dim_pad >= 256:
        return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    # On the H200 (8 x 2048 tokens, GQA 4:1, bf16) this ran as fast as (128, 128, 8 warps) and
    # (128, 64, 8 warps) within noise; the smaller query tile wastes less on short chunks.
    return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)


def big_prefill_config() -> PrefillConfig:
    """Query tiles of 256 rows (16 warps, one program per SM) for batches with many new tokens
    (bf16/fp16, head_dim <= 128): each key tile then serves four times as many query rows.

    `python -m benchmarks.kernels --sweep` times both tiles on several batch compositions
    (the README's Kernels section has the figures): the tall tile wins on large prompt batches and
    loses where few programs under-fill the GPU, hence `_BIG_PREFILL_MIN_WAVES`; that rule only
    counts programs, so it misses long ones that would still win (a few chunks after a long cached
    prefix).
    """
    return PrefillConfig(block_m=256, block_n=64, num_warps=16, num_stages=2)


@functools.lru_cache(maxsize=1024)
def choose_prefill_config(
    num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, head_dim_pad: int, dtype: torch.dtype,
    sm_count: int,
) -> PrefillConfig:  # fmt: skip
    """`big_prefill_config` when its tiles give every SM at least `_BIG_PREFILL_MIN_WAVES` programs,
    else `default_prefill_config`; from shapes only.

    The tiles are counted over `num_tokens - num_seqs` tokens: the fewest that can belong to
    sequences with more than one new token, which are the varlen kernel's (decodes are not).
    """
    default = default_prefill_config(head_dim_pad, dtype)
    if dtype == torch.float32 or head_dim_pad > 128:
        return default
    big = big_prefill_config()
    big_tiles = (num_tokens - num_seqs) // max(1, big.block_m // _pow2_at_least(group))
    if big_tiles * num_kv_heads >= _BIG_PREFILL_MIN_WAVES * sm_count:
        return big
    return default


def single_tile_decode_config(head_dim_pad: int, dtype: torch.dtype) -> DecodeConfig:
    """Decode with one key tile per program (small batches): a big tile, so that few splits (a
    short merge) still give every SM programs, and 8 warps to keep its K and V in registers.

    num_stages only matters for the merge loop. No spills and <= 128 registers (ptxas, sm_90).
    """
    if dtype == torch.float32:
        return DecodeConfig(block_n=32, num_warps=8, num_stages=2)
    if head_dim_pad >= 256:
        return DecodeConfig(block_n=64, num_warps=8, num_stages=2)
    return DecodeConfig(block_n=128, num_warps=8, num_stages=2)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of the device; the H200's 132 stands in off the GPU (interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


@functools.lru_cache(maxsize=1024)
def choose_decode_launch(
    num_tokens: int, num_kv_heads: int, max_context: int, head_dim_pad: int, dtype: torch.dtype, sm_count: int
) -> tuple[DecodeConfig, int]:
    """Decode config and split count, from shapes only.

    One key tile per program (`single_tile_decode_config`) when that covers the whole context in one
    wave with at most `_MAX_SPLITS` splits; otherwise `default_decode_config` and
    `choose_num_splits`.
    """
    single = single_tile_decode_config(head_dim_pad, dtype)
    tiles = _cdiv(max_context, single.block_n)
    if (
        1 < tiles <= _MAX_SPLITS
        and num_tokens * num_kv_heads * tiles <= _SINGLE_TILE_PROGRAMS_PER_SM * sm_count
    ):
        return single, tiles
    config = default_decode_config(head_dim_pad, dtype)
    return config, choose_num_splits(num_tokens, num_kv_heads, max_context, config.block_n, sm_count)


@functools.lru_cache(maxsize=1024)
def choose_num_splits(
    num_tokens: int, num_kv_heads: int, max_context: int, block_n: int, sm_count: int,
    programs_per_sm: int = _RESIDENT_PROGRAMS_PER_SM,
) -> int:  # fmt: skip
    """Split-KV partitions for the decode kernel with a looping config, from shapes only.

    The smallest count whose programs (tokens x KV heads x splits) fill the GPU's resident slots
    to `_WAVE_EFFICIENCY`, else the best-filling one; never a partition shorter than
    `_MIN_TOKENS_PER_SPLIT` keys (or one key block), never more than `_MAX_SPLITS`. Batches that
    fill two waves on their own are not split.
    """
    base = num_tokens * num_kv_heads
    slots = programs_per_sm * sm_count
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


@dataclass(frozen=True)
class _DecodePlan:
    """Everything about a decode launch that follows from shapes (computed once per shape)."""

    grid: tuple[int, int, int]
    num_splits: int
    tokens_per_split: int
    table_tokens: int
    part_rows: int  # partial rows (grid rows x query heads x splits); 0 without splits
    part_elements: int  # fp32 scratch: part_rows x (D_PAD accumulators + max + denominator)
    meta: dict[str, Any]  # constexpr arguments, num_warps and num_stages (never mutated)
    merge_meta: dict[str, Any]  # the same for `merge_kernel` (empty without splits)


@functools.lru_cache(maxsize=4096)
def _decode_plan(
    num_rows: int,
    num_q_heads: int,
    head_dim: int,
    num_kv_heads: int,
    page_size: int,
    table_width: int,
    dtype: torch.dtype,
    sm_count: int,
    config: DecodeConfig | None,
    num_splits: int | None,
    by_seq: bool,
    heads_per_program: int = 1,
    window: int | None = None,
    soft_cap: bool = False,
) -> _DecodePlan:
    """Grid, split geometry and meta-parameters of the decode kernel (and the merge) for one shape.

    num_rows: grid rows, one per sequence (= per token in a decode batch).
    window: the sliding window (`_binding_window`: None where it cannot exclude a key); a token then
    reads at most `window` keys, so the launch is chosen and split as for a context of that length.
    soft_cap: whether the kernel applies one (its value is a launch argument).

    Splits are whole multiples of block_n keys; a split count that does not divide the context
    evenly is rounded so no split is empty for the longest possible sequence.
    """
    group = num_q_heads // num_kv_heads
    d_pad = _pow2_at_least(head_dim, 16)
    table_tokens = table_width * page_size
    span = table_tokens if window is None else min(window, table_tokens)  # keys one token reads
    if config is None and num_splits is None:
        config, num_splits = choose_decode_launch(num_rows, num_kv_heads, span, d_pad, dtype, sm_count)
    config = config or default_decode_config(d_pad, dtype)
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_kv_heads, span, config.block_n, sm_count)
    tokens_per_split = max(1, _cdiv(_cdiv(span, num_splits), config.block_n)) * config.block_n
    num_splits = max(1, _cdiv(span, tokens_per_split))
    split = num_splits > 1
    part_rows = num_rows * num_q_heads * num_splits if split else 0
    meta = dict(
        GROUP=group,
        G_PAD=_pow2_at_least(group, 16),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE_SIZE=page_size,
        BLOCK_N=config.block_n,
        SPLIT=split,
        SINGLE_TILE=split and tokens_per_split == config.block_n,
        FIT_SPLITS=split and tokens_per_split > config.block_n and FIT_SPLITS,
        BY_SEQ=by_seq,
        WINDOW=window is not None,
        SOFT_CAP=soft_cap,
        DOT_PREC=_dot_precision(dtype),
        DOT_FP32=_dot_in_fp32(dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    merge_meta = {}
    if split:
        s_pad = _pow2_at_least(num_splits)
        warps = min(8, _pow2_at_least(_cdiv(s_pad * d_pad, 32 * _MERGE_ELEMENTS_PER_THREAD)))
        merge_meta = dict(
            HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=s_pad, BY_SEQ=by_seq, num_warps=warps, num_stages=1
        )
    return _DecodePlan(
        grid=(num_rows, _cdiv(num_kv_heads, heads_per_program), num_splits),
        num_splits=num_splits,
        tokens_per_split=tokens_per_split,
        table_tokens=table_tokens,
        part_rows=part_rows,
        part_elements=part_rows * (d_pad + 2),
        meta=meta,
        merge_meta=merge_meta,
    )


@functools.lru_cache(maxsize=256)
def _varlen_meta(
    num_q_heads: int,
    head_dim: int,
    num_kv_heads: int,
    page_size: int,
    dtype: torch.dtype,
    config: PrefillConfig,
    seqs_pad: int,
    windowed: bool = False,
    soft_cap: bool = False,
) -> tuple[int, dict[str, Any]]:
    """Query tokens per tile and the meta-parameters of the varlen kernel for one shape."""
    group = num_q_heads // num_kv_heads
    d_pad = _pow2_at_least(head_dim, 16)
    g_pad = _pow2_at_least(group)
    block_q = max(1, config.block_m // g_pad)
    if block_q * g_pad < 16:  # tl.dot needs at least 16 rows
        block_q = 16 // g_pad
    meta = dict(
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE_SIZE=page_size,
        BLOCK_N=config.block_n,
        SEQS_PAD=seqs_pad,
        WINDOW=windowed,
        SOFT_CAP=soft_cap,
        DOT_PREC=_dot_precision(dtype),
        DOT_FP32=_dot_in_fp32(dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return block_q, meta


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
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _INTERPRETED)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 products are exact ("ieee"): tf32 would cost ~1e-3 relative error."""
    return "ieee" if _dot_in_fp32(dtype) else "tf32"


# --------------------------------------------------------------------------------------------- #
# Split-KV scratch (see the module docstring)
# --------------------------------------------------------------------------------------------- #

_SCRATCH: dict[torch.device, torch.Tensor] = {}
_OUTGROWN_SCRATCH: list[torch.Tensor] = []  # kept alive: captured graphs may still use them
_MIN_SCRATCH_ELEMENTS = 1 << 16


def _split_scratch(device: torch.device, part_elements: int) -> torch.Tensor:
    """The device's fp32 buffer for split partials, at least `part_elements` long.

    Grows by doubling, so a server allocates a handful of times in all. A CUDA graph capture that
    outgrows the cached buffer gets one of its own (from the graph's pool) instead of replacing it.
    """
    cached = _SCRATCH.get(device)
    if cached is not None and cached.numel() >= part_elements:
        return cached
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(part_elements, dtype=torch.float32, device=device)
    size = _MIN_SCRATCH_ELEMENTS
    if cached is not None:
        size = 2 * cached.numel()
        _OUTGROWN_SCRATCH.append(cached)
    part = torch.empty(max(size, part_elements), dtype=torch.float32, device=device)
    _SCRATCH[device] = part
    return part


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
    assert k_cache.dtype == v_cache.dtype, "the k and v caches must share a dtype"
    assert k_cache.dtype in (q.dtype, _FP8), "the caches must be q's dtype or float8_e4m3fn"
    assert block_tables.dim() == 2 and block_tables.shape[0] == seq_lens.shape[0]
    assert cu_seqlens_q.shape == (seq_lens.shape[0] + 1,), "cu_seqlens_q must be [num_seqs + 1]"
    device = q.device
    for t in (block_tables, seq_lens, cu_seqlens_q):
        assert t.dtype in (torch.int32, torch.int64), "index tensors must be integer"
        assert t.device == device, "all tensors must be on one device"
    assert seq_lens.stride(0) == 1 and cu_seqlens_q.stride(0) == 1 and block_tables.stride(1) == 1
    if out is not None:
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == device


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention over a mixed batch; see `kernels.reference.paged_attention`.

    The keyword-only arguments override the shape-based choices (for tests and tuning);
    k_scale / v_scale are the FP8 caches' scales (float32 [1] on q's device); sliding_window and
    soft_cap are the layer's (Mistral's and Gemma's attention: see the module docstring).
    """
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    decode_batch = q.shape[0] == seq_lens.shape[0]
    scales = _kv_scales(k_cache, k_scale, v_scale, q.device)
    scores = score_options(scale, sliding_window, soft_cap, block_tables.shape[1] * k_cache.shape[1])
    args = (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out)
    # A mixed batch: the decode kernel takes its sequences of one new token, the varlen kernel the
    # others (it is slower at decodes).
    _launch_decode(*args, decode_config, num_splits, by_seq=not decode_batch, scales=scales, scores=scores)
    if not decode_batch:
        _launch_varlen(*args, prefill_config, scales=scales, scores=scores)
    return out


@dataclass(frozen=True)
class ScoreOptions:
    """How a launch turns q.k into softmax exponents: the launch arguments `qk_scale` and
    `cap_scale`, and the constexprs they go with.

    Without a soft-cap the exponent is q.k * scale * log2(e) (qk_scale); with one it is
    tanh(q.k * scale / cap) * cap * log2(e) (cap_scale, then qk_scale). `window` is the sliding
    window where it can exclude a key of this table (`binding_window`), else None.
    """

    qk_scale: float
    cap_scale: float
    window: int | None
    soft_cap: bool

    @property
    def window_arg(self) -> int:
        return 0 if self.window is None else self.window


def binding_window(sliding_window: int | None, table_tokens: int) -> int | None:
    """The window, or None where it cannot exclude a key: a table of `table_tokens` positions
    holds no query at or past the window, so every query sees all its keys. From shapes only (a
    CUDA graph keeps its table width), and it keeps such launches on the kernels without a window
    (the CUDA FP8 decode kernel among them)."""
    if sliding_window is None or sliding_window >= table_tokens:
        return None
    return sliding_window


def score_options(
    scale: float, sliding_window: int | None, soft_cap: float | None, table_tokens: int
) -> ScoreOptions:
    """The launch's `ScoreOptions`, with the arguments checked."""
    if sliding_window is not None:
        assert isinstance(sliding_window, int) and sliding_window >= 1, "sliding_window: a positive int"
    window = binding_window(sliding_window, table_tokens)
    if soft_cap is None:
        return ScoreOptions(scale * _LOG2E, 1.0, window, False)
    assert soft_cap > 0, "soft_cap must be positive"
    return ScoreOptions(soft_cap * _LOG2E, scale / soft_cap, window, True)


def _kv_scales(
    cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers a launch passes: the FP8 caches' (one float32 each, 1.0 when absent), or
    any device tensor for other caches (never read there)."""
    if cache.dtype != _FP8:
        return cache, cache
    one = None
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=device)
    k_scale, v_scale = (one if k_scale is None else k_scale), (one if v_scale is None else v_scale)
    for t in (k_scale, v_scale):
        assert t.dtype == torch.float32 and t.numel() == 1 and t.device == device, "scales: float32 [1]"
    return k_scale, v_scale


def _fp8_mode(cache: torch.Tensor, q_dtype: torch.dtype, widen: int) -> int:
    """The kernels' KV_FP8 constexpr: 0 for caches in the model dtype; `widen` for FP8 caches,
    but for float32 queries (their products run in float32 from plain casts)."""
    if cache.dtype != _FP8:
        return 0
    return WIDEN_TO_Q_DTYPE.value if q_dtype == torch.float32 else widen


def decode_plan(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    config: DecodeConfig | None = None,
    num_splits: int | None = None,
    by_seq: bool = False,
    heads_per_program: int = 1,
    window: int | None = None,
    soft_cap: bool = False,
) -> _DecodePlan:
    """The decode launch `paged_attention` would make for these shapes (for the benchmark and tests);
    heads_per_program > 1 for the CUDA kernel, whose programs take several KV heads; window: a
    sliding window (as `binding_window` leaves it); soft_cap: whether a cap is applied."""
    _, num_q_heads, head_dim = q.shape
    return _decode_plan(
        block_tables.shape[0],
        num_q_heads,
        head_dim,
        k_cache.shape[2],
        k_cache.shape[1],
        block_tables.shape[1],
        q.dtype,
        _sm_count(q.device),
        config,
        num_splits,
        by_seq,
        heads_per_program,
        window,
        soft_cap,
    )


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
    by_seq: bool,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scores: ScoreOptions | None = None,
    rotary: DecodeRotary | None = None,
) -> None:
    scales = scales or _kv_scales(k_cache, None, None, q.device)
    scores = scores or score_options(scale, None, None, 0)
    assert rotary is None or k_cache.dtype == q.dtype, "the decode kernel rotates over caches in q's dtype"
    # The CUDA FP8 kernel has neither a window nor a cap: such layers take the Triton FP8 kernel
    # (the module docstring says why).
    plain = scores.window is None and not scores.soft_cap
    cuda_config = FP8_DECODE_CUDA if config is None and plain else None
    cuda_kernel = None
    if cuda_config is not None and cuda_decode.applies(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out
    ):
        cuda_config = cuda_decode.fitted(cuda_config, k_cache.shape[2])
        cuda_kernel = cuda_decode.compiled_kernel(q, k_cache, cuda_config, FIT_SPLITS)
    if cuda_kernel is not None:
        plan = _cuda_decode_plan(q, k_cache, block_tables, cuda_config, num_splits, by_seq)
        part = _split_scratch(q.device, plan.part_elements) if plan.part_rows else out
        cuda_decode.launch(
            cuda_kernel, q, k_cache, v_cache, out, part, block_tables, seq_lens, cu_seqlens_q, *scales,
            scale * _LOG2E, plan.grid, plan.num_splits, plan.tokens_per_split, plan.part_rows, by_seq,
            cuda_config,
        )  # fmt: skip
        _launch_merge(plan, out, part, cu_seqlens_q)
        return
    plan = decode_plan(
        q, k_cache, block_tables, config, num_splits, by_seq, window=scores.window, soft_cap=scores.soft_cap
    )
    part = _split_scratch(q.device, plan.part_elements) if plan.part_rows else out  # unread unsplit
    if rotary is None:  # the pointers are never read
        rotary_args, rotary_strides, compile_options = (q,) * 6, (0,) * 5, {}
    else:
        rotary_args = (rotary.positions, rotary.key, rotary.value, rotary.cos, rotary.sin)
        rotary_args += (rotary.slot_mapping,)
        rotary_strides = (*rotary.key.stride()[:2], *rotary.value.stride()[:2], rotary.cos.stride(0))
        compile_options = {"enable_fp_fusion": False}  # the rotation rounds as the rotary kernel's
    decode_kernel[plan.grid](
        q,
        k_cache,
        v_cache,
        out,
        part,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        *scales,
        *rotary_args,
        scores.qk_scale,
        scores.cap_scale,
        scores.window_arg,
        seq_lens.shape[0],
        plan.num_splits,
        plan.tokens_per_split,
        plan.table_tokens,
        plan.part_rows,
        *rotary_strides,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
        **plan.meta,
        KV_FP8=_fp8_mode(k_cache, q.dtype, FP8_DECODE_WIDEN),
        ROTARY=rotary is not None,
        **pdl_launch_args(q.device),
        **compile_options,
    )
    _launch_merge(plan, out, part, cu_seqlens_q)


def _launch_merge(
    plan: _DecodePlan, out: torch.Tensor, part: torch.Tensor, cu_seqlens_q: torch.Tensor
) -> None:
    """Merges a split decode launch's partials into `out` (nothing to do unsplit)."""
    if plan.part_rows:
        merge_kernel[plan.grid[0], out.shape[1]](
            out,
            part,
            cu_seqlens_q,
            plan.num_splits,
            plan.part_rows,
            *out.stride(),
            **plan.merge_meta,
            **pdl_launch_args(out.device),
        )


def _cuda_decode_plan(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    config: cuda_decode.CudaDecodeConfig,
    num_splits: int | None,
    by_seq: bool,
) -> _DecodePlan:
    """The geometry of a CUDA FP8 decode launch: the Triton plan's splits (whole 64-key tiles, as
    few as give every SM `_CUDA_HEADS_PER_SM` warps) with `config.warps` KV heads per program."""
    tile = DecodeConfig(block_n=64, num_warps=config.warps, num_stages=config.stages)
    if num_splits is None:
        num_splits = choose_num_splits(
            block_tables.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1], tile.block_n,
            _sm_count(q.device), _CUDA_HEADS_PER_SM,
        )  # fmt: skip
    return decode_plan(q, k_cache, block_tables, tile, num_splits, by_seq, heads_per_program=config.warps)


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
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scores: ScoreOptions | None = None,
) -> None:
    scales = scales or _kv_scales(k_cache, None, None, q.device)
    scores = scores or score_options(scale, None, None, 0)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if config is None:
        config = choose_prefill_config(
            num_tokens, num_seqs, num_kv_heads, num_q_heads // num_kv_heads,
            _pow2_at_least(head_dim, 16), q.dtype, _sm_count(q.device),
        )  # fmt: skip
    block_q, meta = _varlen_meta(
        num_q_heads, head_dim, num_kv_heads, k_cache.shape[1], q.dtype, config, _seqs_pad(num_seqs),
        scores.window is not None, scores.soft_cap,
    )  # fmt: skip
    num_tiles = num_tokens // block_q + num_seqs
    varlen_kernel[(num_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        *scales,
        scores.qk_scale,
        scores.cap_scale,
        scores.window_arg,
        num_seqs,
        num_tiles,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
        **meta,
        KV_FP8=_fp8_mode(k_cache, q.dtype, FP8_PREFILL_WIDEN),
    )


def _check_kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Checks what every launch that stores new keys and values at their slots takes."""
    assert key.shape == value.shape, "key and value must have the same shape"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert key.shape[1:] == k_cache.shape[2:], "key/value heads or head_dim disagree with the cache"
    assert slot_mapping.shape == (key.shape[0],) and slot_mapping.dtype in (torch.int32, torch.int64)
    assert slot_mapping.stride(0) == 1 or slot_mapping.numel() <= 1


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Stores each token's key and value at its slot; see `kernels.reference.write_kv`."""
    assert key.dim() == 3, "key/value must be [num_tokens, kv_heads, head_dim]"
    _check_kv_write(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *_kv_scales(k_cache, k_scale, v_scale, key.device),
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        D_PAD=_pow2_at_least(head_dim, 16),
        KV_FP8=k_cache.dtype == _FP8,
        num_warps=1,
    )


def _check_rotary_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> RotaryLaunch:
    """Checks what a launch that rotates and writes the new keys takes (`check_rotary`, then
    `_check_kv_write` and contiguous head rows) and returns the rotary kernel's cut of the heads."""
    launch = check_rotary(positions, q, key, cos, sin)
    _check_kv_write(key, value, k_cache, v_cache, slot_mapping)
    assert value.stride(2) == 1, "value head rows must be contiguous"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache head rows must be contiguous"
    return launch


def rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`kernels.layers.rotary_embedding` then `write_kv` in one launch; see `kernels.rotary_write_kv`."""
    launch = _check_rotary_write(positions, q, key, value, cos, sin, k_cache, v_cache, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    rotary_write_kv_kernel[(num_tokens, launch.head_blocks)](
        positions, q, key, value, cos, sin, k_cache, v_cache, slot_mapping,
        *_kv_scales(k_cache, k_scale, v_scale, key.device),
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), num_q_heads, key.shape[1],
        PAGE_SIZE=k_cache.shape[1], HALF=head_dim // 2, HALF_PAD=launch.half_pad, BLOCK_H=launch.block_h,
        KV_FP8=k_cache.dtype == _FP8, **pdl_launch_args(q.device), num_warps=launch.num_warps,
        enable_fp_fusion=False,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodeRotary:
    """What `rotary_write_kv` would take besides q and the caches, for a decode launch that does its
    work itself (`attention_jit.decode_kernel`'s ROTARY)."""

    positions: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


# `PAGEDSERVE_DECODE_ROTARY=1` has the decode launch rotate and write (`rotary_paged_attention`).
# Off by default until it has been compiled and timed on a GPU: it is tested under the interpreter
# only so far (the CUDA tests are written).
DECODE_ROTARY = os.environ.get("PAGEDSERVE_DECODE_ROTARY", "0") == "1"


def fuses_rotary(q: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor, decode_only: bool) -> bool:
    """Whether `rotary_paged_attention` rotates and writes inside the decode launch, from shapes
    only: a decode batch (decode_only: the caller knows every sequence has exactly one new token;
    a batch whose token count equals its sequence count may still hide one with two beside one with
    none, and another program would then read a key before its writer stored it) with head_dim a
    power of two of at least 16 (whole rows, no padding columns) over caches in q's dtype (FP8
    caches decode on the CUDA kernel, which rotates nothing)."""
    head_dim = q.shape[2]
    return (
        DECODE_ROTARY
        and decode_only
        and q.shape[0] == seq_lens.shape[0]
        and head_dim == _pow2_at_least(head_dim, 16)
        and k_cache.dtype == q.dtype
    )


def rotary_paged_attention(
    positions: torch.Tensor,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    decode_only: bool,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """`rotary_write_kv` then `paged_attention`; see `kernels.rotary_paged_attention`. Where
    `fuses_rotary` holds, one decode launch does all of it and leaves q and key unrotated in memory
    (the caches hold what the two launches would write)."""
    if not fuses_rotary(q, k_cache, seq_lens, decode_only):
        rotary_write_kv(positions, q, key, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, k_scale=k_scale,
            v_scale=v_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        )  # fmt: skip
    _check_rotary_write(positions, q, key, value, cos, sin, k_cache, v_cache, slot_mapping)
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, None)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    scores = score_options(scale, sliding_window, soft_cap, block_tables.shape[1] * k_cache.shape[1])
    _launch_decode(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, None, None, by_seq=False,
        scales=_kv_scales(k_cache, k_scale, v_scale, q.device), scores=scores,
        rotary=DecodeRotary(positions, key, value, cos, sin, slot_mapping),
    )  # fmt: skip
    return out
