"""Triton paged-attention kernels against the plain-torch reference, and the reference against SDPA.

Off the GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before Triton is imported). On a CUDA machine the same cases run the compiled
kernels on CUDA tensors, plus a few tests that only make sense there (CUDA graph capture, offsets
beyond 2^31 elements). Every check draws fresh random inputs; outputs are poisoned with NaN first
so unwritten rows fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import kernels
from pagedserve.kernels import reference
from pagedserve.kernels import triton_attention as ta
from tests.triton_marks import DEVICE, INTERPRETED, needs_cuda, needs_triton

TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


# --------------------------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------------------------- #


def make_batch(
    q_lens: list[int],
    context_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    num_blocks: int | None = None,
    min_block_id: int = 0,
    extra_table_cols: int = 1,
    device: str = DEVICE,
    seed: int = 0,
) -> dict:
    """A random paged batch: shuffled block tables over a pool, random KV in the blocks in use.

    Blocks in use are drawn from [min_block_id, num_blocks); the block tables get a spare column
    (filled with a wrong-but-valid block) so kernels that read past a sequence's end would be caught.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(c + block_size - 1) // block_size for c in context_lens]
    needed = sum(blocks_per_seq)
    if num_blocks is None:
        num_blocks = min_block_id + needed + 8
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(cache_shape, dtype=dtype, device=device)
    v_cache = torch.empty(cache_shape, dtype=dtype, device=device)
    ids = min_block_id + torch.randperm(num_blocks - min_block_id, generator=gen)[: needed + 1]
    used, spare = ids[:needed], ids[needed]
    # Only the blocks in use (and the spare) hold data: a big pool stays cheap.
    touched = ids.to(device)
    k_cache[touched] = torch.randn((needed + 1, *cache_shape[1:]), generator=gen).to(dtype).to(device)
    v_cache[touched] = torch.randn((needed + 1, *cache_shape[1:]), generator=gen).to(dtype).to(device)
    width = max(blocks_per_seq + [1]) + extra_table_cols
    block_tables = torch.full((len(q_lens), width), int(spare), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = used[start : start + n]
        start += n
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn((int(cu[-1]), num_q_heads, head_dim), generator=gen).to(dtype).to(device)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        scale=head_dim**-0.5,
    )


def reference_fp32(batch: dict, **variant) -> torch.Tensor:
    """The reference on fp32 copies of the inputs, on the CPU (variant: sliding_window, soft_cap)."""
    return reference.paged_attention(
        batch["q"].float().cpu(),
        batch["k_cache"].float().cpu(),
        batch["v_cache"].float().cpu(),
        batch["block_tables"].cpu(),
        batch["seq_lens"].cpu(),
        batch["cu_seqlens_q"].cpu(),
        batch["scale"],
        **variant,
    )


def run_triton(batch: dict, **overrides) -> torch.Tensor:
    out = torch.full_like(batch["q"], float("nan"))
    result = ta.paged_attention(**batch, out=out, **overrides)
    assert result is out
    return out


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    actual = actual.float().cpu()
    assert not actual.isnan().any(), "output has NaN (unwritten rows?)"
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# A mixed batch: a decode, a chunk with cached context, a sequence with no new tokens, a whole
# prompt, another decode; lengths end mid-block.
MIXED_Q_LENS = [1, 7, 0, 19, 1]
MIXED_CONTEXT = [33, 40, 5, 19, 70]
DECODE_CONTEXT = [1, 17, 64, 45]

SHAPES = [
    # dtype, head_dim, num_q_heads, num_kv_heads, block_size
    pytest.param(torch.float32, 64, 4, 4, 16, id="fp32-d64-1to1-bs16"),
    pytest.param(torch.bfloat16, 128, 8, 2, 16, id="bf16-d128-4to1-bs16"),
    pytest.param(torch.float16, 80, 10, 2, 32, id="fp16-d80-5to1-bs32"),
    pytest.param(torch.bfloat16, 96, 4, 1, 32, id="bf16-d96-4to1-bs32"),
    pytest.param(torch.float16, 256, 2, 1, 16, id="fp16-d256-2to1-bs16"),
    pytest.param(torch.float32, 256, 5, 1, 16, id="fp32-d256-5to1-bs16"),
    pytest.param(torch.bfloat16, 64, 10, 2, 48, id="bf16-d64-5to1-bs48"),
]


# --------------------------------------------------------------------------------------------- #
# The reference against something nobody here wrote
# --------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2)])
def test_reference_matches_sdpa_on_contiguous_cache(num_q_heads: int, num_kv_heads: int) -> None:
    """The reference equals SDPA with a bottom-right causal mask, sequence by sequence."""
    batch = make_batch([3, 1, 9], [10, 20, 9], num_q_heads, num_kv_heads, 32, 16, torch.float32, device="cpu")
    expected = torch.empty_like(batch["q"])
    cu = batch["cu_seqlens_q"].tolist()
    for i, ctx in enumerate(batch["seq_lens"].tolist()):
        q_len = cu[i + 1] - cu[i]
        n = (ctx + 15) // 16
        blocks = batch["block_tables"][i, :n].long()
        k = batch["k_cache"][blocks].flatten(0, 1)[:ctx].transpose(0, 1)  # [kv_heads, ctx, D]
        v = batch["v_cache"][blocks].flatten(0, 1)[:ctx].transpose(0, 1)
        q = batch["q"][cu[i] : cu[i + 1]].transpose(0, 1)  # [heads, q_len, D]
        mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len)
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=batch["scale"], enable_gqa=True
        )
        expected[cu[i] : cu[i + 1]] = o[0].transpose(0, 1)
    actual = reference.paged_attention(**batch)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_reference_write_kv_skips_padding() -> None:
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reference.write_kv(key, value, k_cache, v_cache, torch.tensor([17, -1, 63]))
    torch.testing.assert_close(k_cache[1, 1], key[0])
    torch.testing.assert_close(v_cache[3, 15], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


# --------------------------------------------------------------------------------------------- #
# Triton against the reference
# --------------------------------------------------------------------------------------------- #


@needs_triton
@pytest.mark.parametrize("dtype, head_dim, num_q_heads, num_kv_heads, block_size", SHAPES)
def test_mixed_batch_matches_reference(dtype, head_dim, num_q_heads, num_kv_heads, block_size) -> None:
    """Varlen kernel: decodes, chunks with cached context, whole prompts and q_len 0 in one call."""
    batch = make_batch(MIXED_Q_LENS, MIXED_CONTEXT, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    assert_matches(run_triton(batch), reference_fp32(batch), dtype)


@needs_triton
@pytest.mark.parametrize("dtype, head_dim, num_q_heads, num_kv_heads, block_size", SHAPES[:3])
@pytest.mark.parametrize("vector_lookup", [True, False], ids=["vector-lookup", "binary-search"])
def test_mixed_batch_splits_its_work_between_the_kernels(
    monkeypatch, vector_lookup, dtype, head_dim, num_q_heads, num_kv_heads, block_size
) -> None:
    """In a mixed batch each kernel writes exactly its own rows: the decode kernel (one grid row per
    sequence, split here: one decode has a long context) those of single-token sequences, the
    varlen kernel the others (both ways of finding a tile's sequence); together, the reference."""
    if not vector_lookup:
        monkeypatch.setattr(ta, "_seqs_pad", lambda num_seqs: 0)
    q_lens, context = [7, 1, 0, 19, 1, 1], [40, 300, 5, 19, 2, 70]
    batch = make_batch(q_lens, context, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=3)
    expected = reference_fp32(batch)
    decode_rows = torch.tensor([7, 27, 28])  # the tokens of the q_len 1 sequences
    args = [
        batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "scale")
    ]
    assert ta.decode_plan(batch["q"], batch["k_cache"], batch["block_tables"], by_seq=True).num_splits > 1
    decodes_only = torch.full_like(batch["q"], float("nan"))
    ta._launch_decode(*args, decodes_only, None, None, by_seq=True)
    others_only = torch.full_like(batch["q"], float("nan"))
    ta._launch_varlen(*args, others_only, None)
    is_decode = torch.zeros(batch["q"].shape[0], dtype=torch.bool)
    is_decode[decode_rows] = True
    assert decodes_only[~is_decode].isnan().all()
    assert others_only[is_decode].isnan().all()
    assert_matches(decodes_only[is_decode], expected[is_decode], dtype)
    assert_matches(others_only[~is_decode], expected[~is_decode], dtype)
    assert_matches(run_triton(batch), expected, dtype)


@needs_triton
@pytest.mark.parametrize("dtype, head_dim, num_q_heads, num_kv_heads, block_size", SHAPES)
def test_decode_batch_matches_reference(dtype, head_dim, num_q_heads, num_kv_heads, block_size) -> None:
    """Decode kernel (num_tokens == num_seqs), with and without split-KV."""
    q_lens = [1] * len(DECODE_CONTEXT)
    batch = make_batch(q_lens, DECODE_CONTEXT, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=1)
    expected = reference_fp32(batch)
    assert_matches(run_triton(batch, num_splits=1), expected, dtype)
    assert_matches(run_triton(batch, num_splits=3), expected, dtype)


@needs_triton
def test_long_decode_uses_split_kv() -> None:
    """A small batch with a long context splits by default, and every split count agrees."""
    batch = make_batch([1, 1], [700, 3], 8, 2, 64, 16, torch.bfloat16, seed=2)
    plan = ta.decode_plan(batch["q"], batch["k_cache"], batch["block_tables"])
    assert plan.num_splits > 1
    assert plan.meta["SINGLE_TILE"]
    expected = reference_fp32(batch)
    assert_matches(run_triton(batch), expected, torch.bfloat16)
    assert_matches(run_triton(batch, num_splits=7), expected, torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("dtype, head_dim, num_q_heads, num_kv_heads, block_size", SHAPES)
def test_decode_split_with_several_tiles_per_split(dtype, head_dim, num_q_heads, num_kv_heads, block_size):
    """Splits that loop over several key tiles (the non-single-tile split variant), then merged."""
    q_lens = [1] * len(DECODE_CONTEXT)
    batch = make_batch(
        q_lens, DECODE_CONTEXT, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=11
    )
    config = ta.DecodeConfig(block_n=16, num_warps=4, num_stages=2)
    plan = ta.decode_plan(batch["q"], batch["k_cache"], batch["block_tables"], config, 2)
    assert plan.num_splits == 2
    assert plan.tokens_per_split > 16
    assert not plan.meta["SINGLE_TILE"]
    assert_matches(run_triton(batch, decode_config=config, num_splits=2), reference_fp32(batch), dtype)


@needs_triton
@pytest.mark.parametrize("splits, single_tile", [(45, True), (23, False)], ids=["single-tile", "looping"])
def test_merge_over_many_splits(splits: int, single_tile: bool) -> None:
    """An odd split count (padded in the merge), GQA 5:1 and a sequence that ends long before the
    table does (splits without keys)."""
    batch = make_batch([1, 1], [700, 21], 10, 2, 64, 16, torch.float16, seed=12)
    config = ta.DecodeConfig(block_n=16, num_warps=4, num_stages=2)
    plan = ta.decode_plan(batch["q"], batch["k_cache"], batch["block_tables"], config, splits)
    assert plan.num_splits == splits
    assert plan.meta["SINGLE_TILE"] == single_tile
    assert plan.merge_meta["S_PAD"] > plan.num_splits
    assert_matches(
        run_triton(batch, decode_config=config, num_splits=splits), reference_fp32(batch), torch.float16
    )


@needs_triton
@pytest.mark.parametrize("window", [None, 200], ids=["full", "window"])
def test_looping_splits_fit_contexts_much_shorter_than_the_table(window: int | None) -> None:
    """A CUDA graph plans the splits for its table's full width (here 41 blocks of 16): each token
    spreads its own context, or its window's keys, over them in whole key tiles (`FIT_SPLITS`), a
    context shorter than one tile per split included, and gives the same result."""
    batch = make_batch([1, 1, 1], [5, 90, 333], 8, 2, 64, 16, torch.float32, extra_table_cols=20, seed=13)
    config = ta.DecodeConfig(block_n=16, num_warps=4, num_stages=2)
    plan = ta.decode_plan(batch["q"], batch["k_cache"], batch["block_tables"], config, 6, window=window)
    assert plan.meta["FIT_SPLITS"] and plan.tokens_per_split > 16 and plan.num_splits > 1
    out = run_triton(batch, decode_config=config, num_splits=6, sliding_window=window)
    assert_matches(out, reference_fp32(batch, sliding_window=window), torch.float32)


@needs_triton
def test_repeated_split_launches_share_the_scratch() -> None:
    """Launches with different split counts reuse one partials buffer; each result stays right, and
    a repeat is bit-identical."""
    batch = make_batch([1, 1, 1], [300, 45, 160], 8, 2, 64, 16, torch.float32, seed=13)
    expected = reference_fp32(batch)
    first = run_triton(batch, num_splits=5)
    assert_matches(first, expected, torch.float32)
    for splits in (5, 3, 5):
        assert_matches(run_triton(batch, num_splits=splits), expected, torch.float32)
    assert torch.equal(run_triton(batch, num_splits=5), first)


@needs_triton
def test_split_scratch_grows_and_keeps_outgrown_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that needs more scratch than cached gets bigger buffers; the old ones stay alive
    (graphs captured with them would still use them)."""
    monkeypatch.setattr(ta, "_SCRATCH", {})
    monkeypatch.setattr(ta, "_OUTGROWN_SCRATCH", [])
    monkeypatch.setattr(ta, "_MIN_SCRATCH_ELEMENTS", 16)
    small = make_batch([1], [100], 4, 2, 64, 16, torch.float32, seed=14)
    assert_matches(run_triton(small, num_splits=2), reference_fp32(small), torch.float32)
    first = ta._SCRATCH[small["q"].device]
    big = make_batch([1, 1, 1], [100, 250, 7], 4, 2, 64, 16, torch.float32, seed=15)
    assert_matches(run_triton(big, num_splits=4), reference_fp32(big), torch.float32)
    assert ta._SCRATCH[small["q"].device].numel() > first.numel()
    assert any(t is first for t in ta._OUTGROWN_SCRATCH)
    assert_matches(run_triton(small, num_splits=2), reference_fp32(small), torch.float32)


@needs_triton
def test_bench_floors_read_every_kv_byte_once() -> None:
    """benchmarks.kernels's floor kernels sum exactly the K and V of the case: the gather floor through
    its block tables, the contiguous floor from the anchor's copies."""
    from benchmarks import kernels as bench

    pool = bench.Pool(64, torch.device(DEVICE))
    inputs = bench.decode_inputs(pool, 2, 128)
    ids = inputs["block_tables"].long().cpu()
    kv = (pool.k.float() + pool.v.float()).cpu()[ids].flatten(1, 2)  # [seqs, tokens, heads, dim]
    expected = kv.sum(dim=(1, 3))
    anchor_kv = bench.contiguous_kv(pool, inputs["block_tables"], 128)
    case = bench.DecodeCase(2, 128, [inputs], [torch.empty_like(inputs["q"])], [(inputs["q"], *anchor_kv)])
    for floor, sums_arg in ((case.gather_floor, 3), (case.contiguous_floor, 2)):
        (launch,) = floor(sm_count=4)
        launch()
        sums = launch.args[sums_arg].view(2, bench.NUM_KV_HEADS, -1).sum(-1)
        torch.testing.assert_close(sums.cpu(), expected, rtol=1e-4, atol=1e-2)


def test_split_heuristic_depends_on_shapes_only() -> None:
    assert ta.choose_num_splits(256, 8, 1024, 64, 132) == 1  # the batch fills the GPU
    assert ta.choose_num_splits(1, 8, 4096, 64, 132) > 8  # one sequence needs splitting
    assert ta.choose_num_splits(1, 8, 64, 64, 132) == 1  # too short to split
    assert ta.choose_num_splits(32, 8, 16384, 64, 132) == 2  # 512 programs: one nearly full wave
    assert ta.choose_num_splits(8, 8, 4096, 64, 132) == 8


def test_prefill_tile_choice() -> None:
    """Tall query tiles only where they still give every SM several programs, and only for 2-byte
    types with head_dim <= 128; by shapes only."""
    bf16, big = torch.bfloat16, ta.big_prefill_config()
    assert ta.choose_prefill_config(8 * 2048, 8, 8, 4, 128, bf16, 132) == big  # K1's prefill
    assert ta.choose_prefill_config(8192, 12, 8, 4, 128, torch.float16, 132) == big  # a full chunk
    default = ta.default_prefill_config(128, bf16)
    assert ta.choose_prefill_config(2048, 1, 8, 4, 128, bf16, 132) == default  # 256 programs
    assert ta.choose_prefill_config(8192, 8000, 8, 4, 128, bf16, 132) == default  # mostly decodes
    assert ta.choose_prefill_config(8192, 12, 8, 4, 256, bf16, 132) == ta.default_prefill_config(256, bf16)
    fp32 = ta.default_prefill_config(128, torch.float32)
    assert ta.choose_prefill_config(8192, 12, 8, 4, 128, torch.float32, 132) == fp32


@needs_triton
@pytest.mark.parametrize(
    "dtype, head_dim, num_q_heads, num_kv_heads",
    [(torch.bfloat16, 128, 8, 2), (torch.float16, 80, 10, 2), (torch.bfloat16, 64, 3, 3)],
)
def test_big_prefill_tiles_match_reference(dtype, head_dim, num_q_heads, num_kv_heads) -> None:
    """`big_prefill_config` on a mixed batch (prompt longer than one tall tile, chunk after cached
    context, decodes, an idle sequence), GQA 4:1, 5:1 and 1:1."""
    batch = make_batch(
        [300, 1, 70, 0, 1], [300, 45, 120, 9, 17], num_q_heads, num_kv_heads, head_dim, 16, dtype, seed=11
    )
    assert_matches(run_triton(batch, prefill_config=ta.big_prefill_config()), reference_fp32(batch), dtype)


def test_decode_launch_choice() -> None:
    """One tile per program when the whole context fits one wave of them, else the looping kernel."""
    bf16 = torch.bfloat16
    single = ta.single_tile_decode_config(128, bf16)
    assert ta.choose_decode_launch(1, 8, 4096, 128, bf16, 132) == (single, 4096 // single.block_n)
    assert ta.choose_decode_launch(4, 8, 1024, 128, bf16, 132) == (single, 1024 // single.block_n)
    looping = ta.default_decode_config(128, bf16)
    assert ta.choose_decode_launch(8, 8, 4096, 128, bf16, 132) == (looping, 8)
    assert ta.choose_decode_launch(256, 8, 1024, 128, bf16, 132) == (looping, 1)
    assert ta.choose_decode_launch(1, 8, 64, 128, bf16, 132) == (looping, 1)  # a single tile: no split


@needs_triton
def test_decode_shape_with_uneven_q_lens() -> None:
    """num_tokens == num_seqs does not imply q_len 1 everywhere: [2, 0, 1] must still be right,
    also where single-tile programs guessed the wrong block table row up front."""
    batch = make_batch([2, 0, 1], [5, 9, 30], 4, 2, 64, 16, torch.float32, seed=3)
    expected = reference_fp32(batch)
    assert_matches(run_triton(batch), expected, torch.float32)
    assert_matches(run_triton(batch, num_splits=2), expected, torch.float32)
    config = ta.DecodeConfig(block_n=16, num_warps=4, num_stages=2)
    assert ta.decode_plan(batch["q"], batch["k_cache"], batch["block_tables"], config, 3).meta["SINGLE_TILE"]
    assert_matches(run_triton(batch, decode_config=config, num_splits=3), expected, torch.float32)


@needs_triton
@pytest.mark.parametrize("lookup", ["vector", "binary-search"])
def test_prefill_longer_than_one_tile(lookup: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole prompts and chunks spanning several query tiles and key blocks, with GQA 5:1; both
    ways the varlen kernel finds a tile's sequence."""
    if lookup == "binary-search":
        monkeypatch.setattr(ta, "_MAX_VECTOR_SEQS", 0)
    batch = make_batch([150, 70, 1, 0, 9], [150, 200, 33, 4, 9], 10, 2, 64, 16, torch.float16, seed=4)
    assert_matches(run_triton(batch), reference_fp32(batch), torch.float16)


@needs_triton
def test_single_prompt() -> None:
    batch = make_batch([37], [37], 4, 2, 64, 32, torch.bfloat16, seed=9)
    assert_matches(run_triton(batch), reference_fp32(batch), torch.bfloat16)


@needs_triton
def test_block_ids_beyond_2_pow_15() -> None:
    """A pool of 33000 blocks, every block in use above 2^15."""
    batch = make_batch(
        [1, 6, 1], [40, 30, 17], 4, 1, 64, 16, torch.float16, num_blocks=33000, min_block_id=32768, seed=5
    )
    expected = reference_fp32(batch)
    assert_matches(run_triton(batch), expected, torch.float16)
    decode = make_batch([1, 1], [40, 17], 4, 1, 64, 16, torch.float16, num_blocks=33000, min_block_id=32768)
    assert_matches(run_triton(decode), reference_fp32(decode), torch.float16)


@needs_triton
def test_noncontiguous_q_and_out() -> None:
    """q as a view of a fused qkv projection; out as a view into a wider buffer."""
    heads, kv_heads, d = 8, 2, 64
    batch = make_batch([1, 5, 3], [20, 5, 40], heads, kv_heads, d, 16, torch.bfloat16, seed=6)
    tokens = batch["q"].shape[0]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=DEVICE).to(torch.bfloat16)
    batch["q"] = qkv[:, : heads * d].view(tokens, heads, d)
    assert not batch["q"].is_contiguous()
    wide = torch.full((tokens, heads, 2 * d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = wide[:, :, :d]
    ta.paged_attention(**batch, out=out)
    assert_matches(out, reference_fp32(batch), torch.bfloat16)
    assert wide[:, :, d:].isnan().all(), "wrote outside out"


@needs_triton
def test_empty_batch() -> None:
    batch = make_batch([0, 0], [3, 4], 4, 2, 64, 16, torch.float16)
    assert run_triton(batch).shape == (0, 4, 64)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_write_kv_matches_reference_with_padding(dtype: torch.dtype) -> None:
    """Random slots with -1 padding, head_dim 80 (masked lanes); nothing else in the pool changes."""
    num_blocks, block_size, kv_heads, d = 64, 32, 2, 80
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d).to(dtype).to(DEVICE)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size)[:9]
    slots[[2, 7]] = -1
    slots = slots.to(DEVICE)
    key = torch.randn(9, kv_heads, d).to(dtype).to(DEVICE)
    value = torch.randn(9, kv_heads, d).to(dtype).to(DEVICE)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, k_expected, v_expected, slots)
    ta.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


@needs_triton
def test_write_kv_into_big_pool() -> None:
    """Slots in blocks beyond 2^15 of a 33000-block pool land where the reference puts them."""
    num_blocks, block_size, kv_heads, d = 33000, 16, 2, 64
    k_cache = torch.empty(num_blocks, block_size, kv_heads, d, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    low = torch.randperm(32768 * block_size)[:3]
    high = 32768 * block_size + torch.randperm((num_blocks - 32768) * block_size)[:4]
    slots = torch.cat([low, torch.tensor([-1]), high]).to(DEVICE)
    key = torch.randn(8, kv_heads, d).to(torch.bfloat16).to(DEVICE)
    value = torch.randn(8, kv_heads, d).to(torch.bfloat16).to(DEVICE)
    ta.write_kv(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    assert torch.equal(k_cache[blocks, offsets], key[keep])
    assert torch.equal(v_cache[blocks, offsets], value[keep])


@needs_triton
def test_write_kv_then_attend_roundtrip() -> None:
    """write_kv with a strided key (view of a fused projection) feeds paged_attention."""
    batch = make_batch([4, 1], [4, 9], 4, 2, 64, 16, torch.float16, seed=7)
    tokens = 5
    kv = torch.randn(tokens, 2, 2, 64, device=DEVICE).to(torch.float16)
    key, value = kv[:, 0], kv[:, 1]
    bt = batch["block_tables"].cpu()
    positions = [(0, p) for p in range(4)] + [(1, 8)]
    slots = torch.tensor([int(bt[s, p // 16]) * 16 + p % 16 for s, p in positions], device=DEVICE)
    ta.write_kv(key, value, batch["k_cache"], batch["v_cache"], slots)
    assert_matches(run_triton(batch), reference_fp32(batch), torch.float16)


# --------------------------------------------------------------------------------------------- #
# Dispatch
# --------------------------------------------------------------------------------------------- #


def test_dispatch_uses_reference_on_cpu_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_ATTENTION", raising=False)

    def fail(*args, **kwargs):
        raise AssertionError("Triton must not run on CPU tensors by default")

    monkeypatch.setattr(ta, "paged_attention", fail)
    monkeypatch.setattr(ta, "write_kv", fail)
    batch = make_batch([1, 3], [5, 3], 4, 2, 32, 16, torch.float32, device="cpu")
    torch.testing.assert_close(kernels.paged_attention(**batch), reference.paged_attention(**batch))
    kernels.write_kv(
        batch["q"][:, :2], batch["q"][:, :2], batch["k_cache"], batch["v_cache"], torch.tensor([0, -1, 5, 6])
    )


@needs_triton
@pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs the interpreter")
def test_dispatch_forced_triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "triton")
    calls = []
    original = ta.paged_attention
    monkeypatch.setattr(ta, "paged_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    batch = make_batch([1, 3], [5, 3], 4, 2, 32, 16, torch.float32, device="cpu")
    torch.testing.assert_close(kernels.paged_attention(**batch), reference_fp32(batch), atol=2e-4, rtol=2e-4)
    assert calls


@needs_cuda
def test_dispatch_triton_on_cuda_and_forced_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_ATTENTION", raising=False)
    batch = make_batch([1, 3], [5, 3], 4, 2, 64, 16, torch.float16)
    expected = reference_fp32(batch)
    assert_matches(kernels.paged_attention(**batch), expected, torch.float16)
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "reference")
    monkeypatch.setattr(ta, "paged_attention", None)  # would fail if called
    assert_matches(kernels.paged_attention(**batch), expected, torch.float16)


# --------------------------------------------------------------------------------------------- #
# CUDA only
# --------------------------------------------------------------------------------------------- #


@needs_cuda
def test_cuda_graph_capture_of_decode() -> None:
    """Capture once, then change lengths and block tables in place: replays follow the new values."""
    shape = dict(
        num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16, num_blocks=128
    )
    batch = make_batch([1] * 4, [300, 20, 1, 77], **shape, extra_table_cols=30)
    out = torch.empty_like(batch["q"])
    ta.paged_attention(**batch, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.paged_attention(**batch, out=out)
    for step in range(3):
        fresh = make_batch([1] * 4, [200 + step, 2, 33, 500], **shape, seed=10 + step)
        width = fresh["block_tables"].shape[1]
        assert width <= batch["block_tables"].shape[1]
        batch["k_cache"].copy_(fresh["k_cache"])
        batch["v_cache"].copy_(fresh["v_cache"])
        batch["block_tables"].zero_()
        batch["block_tables"][:, :width].copy_(fresh["block_tables"])
        batch["seq_lens"].copy_(fresh["seq_lens"])
        batch["q"].copy_(fresh["q"])
        graph.replay()
        assert_matches(out, reference_fp32(batch), torch.bfloat16)


@needs_cuda
def test_cuda_graph_of_back_to_back_split_decodes() -> None:
    """Several split-KV launches (and their merges) in one graph share the scratch; replays stay right."""
    shape = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    batches = [make_batch([1], [2000 + 100 * i], **shape, seed=20 + i) for i in range(3)]
    outs = [torch.empty_like(b["q"]) for b in batches]
    for b, o in zip(batches, outs, strict=True):
        ta.paged_attention(**b, out=o)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b, o in zip(batches, outs, strict=True):
            ta.paged_attention(**b, out=o)
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        for b, o in zip(batches, outs, strict=True):
            assert_matches(o, reference_fp32(b), torch.bfloat16)


@needs_cuda
def test_cuda_offsets_beyond_2_pow_31_elements() -> None:
    """Blocks whose element offset overflows int32 (a 4.3 GB pool): 64-bit addressing is needed."""
    block_size, kv_heads, d = 16, 8, 128
    per_block = block_size * kv_heads * d
    num_blocks = (2**31) // per_block + 64
    batch = make_batch(
        [1, 1, 5], [40, 300, 21], 32, kv_heads, d, block_size, torch.bfloat16,
        num_blocks=num_blocks, min_block_id=num_blocks - 60, seed=8,
    )  # fmt: skip
    assert int(batch["block_tables"].min()) * per_block >= 2**31
    expected = reference_fp32(batch)
    assert_matches(run_triton(batch), expected, torch.bfloat16)
    decode = {**batch, "q": batch["q"][:3], "cu_seqlens_q": torch.arange(4, dtype=torch.int32, device=DEVICE)}
    assert_matches(run_triton(decode), reference_fp32(decode), torch.bfloat16)
    slots = batch["block_tables"][:, 0].long() * block_size + 5
    key = torch.randn(3, kv_heads, d, device=DEVICE).to(torch.bfloat16)
    ta.write_kv(key, key, batch["k_cache"], batch["v_cache"], slots)
    torch.testing.assert_close(batch["k_cache"][batch["block_tables"][:, 0].long(), 5], key)
