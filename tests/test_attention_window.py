"""Sliding windows and soft-caps in the Triton paged-attention kernels, against the reference.

The reference (`kernels.reference.paged_attention`) defines both: a query at position p sees the
keys at positions > p - window, scores after the scale become cap * tanh(score / cap). The window
cases cover windows smaller than a block, equal to one, not a multiple of one, and longer than
most contexts (but shorter than the table, so the kernels still apply it); chunks that cross a
window's edge; decodes and prefill chunks in one batch; GQA groups 1, 2, 4, 8; head_dim 64 to 256;
FP8 caches. The blocks wholly before a window may belong to another sequence by now: the stale-block
tests fill them, and the blocks their table entries point to, with NaN, and the outputs must stay
finite. Off the GPU the kernels run under the interpreter with tiny shapes; CUDA adds realistic
shapes (Mistral, Gemma 2 and 3) and CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import cuda_decode, reference
from pagedserve.kernels import triton_attention as ta
from tests.test_kernels import (
    DECODE_CONTEXT,
    MIXED_CONTEXT,
    MIXED_Q_LENS,
    assert_matches,
    make_batch,
    reference_fp32,
    run_triton,
)
from tests.triton_marks import INTERPRETED, needs_cuda, needs_triton

FP8 = torch.float8_e4m3fn
FP8_NAN_BYTE = 0x7F  # e4m3fn: exponent and mantissa all ones

WINDOW_SHAPES = [
    # dtype, head_dim, num_q_heads, num_kv_heads, block_size
    pytest.param(torch.float32, 64, 4, 4, 16, id="fp32-d64-group1"),
    pytest.param(torch.bfloat16, 128, 8, 4, 16, id="bf16-d128-group2"),
    pytest.param(torch.float16, 64, 8, 2, 16, id="fp16-d64-group4"),
    pytest.param(torch.bfloat16, 64, 8, 1, 32, id="bf16-d64-group8-bs32"),
    pytest.param(torch.float16, 256, 2, 1, 16, id="fp16-d256-group2"),
]
# Smaller than a block, one block, not a multiple of the block, longer than most contexts here.
WINDOWS = [5, 16, 23, 60]


def run_both_ways(batch: dict, dtype: torch.dtype, **variant) -> None:
    """The Triton kernels with `variant` against the reference with it."""
    assert_matches(run_triton(batch, **variant), reference_fp32(batch, **variant), dtype)


def first_visible_key(context_len: int, q_len: int, window: int) -> int:
    """The first key any of a sequence's new tokens can see (the reference's rule)."""
    return max(0, context_len - q_len - window + 1)


def poison_out_of_window(batch: dict, window: int) -> int:
    """Makes every block wholly before a sequence's window unreadable: the blocks themselves are
    filled with NaN, and their table entries are pointed at another block of NaN (as if the
    scheduler had freed them and another sequence taken them). Returns how many entries it changed."""
    k_cache, v_cache, tables = batch["k_cache"], batch["v_cache"], batch["block_tables"]
    block_size = k_cache.shape[1]
    in_use = set(tables.flatten().tolist())
    poison = next(b for b in range(k_cache.shape[0]) if b not in in_use)
    cu, lens = batch["cu_seqlens_q"].tolist(), batch["seq_lens"].tolist()
    stale = [poison]
    changed = 0
    for i, context_len in enumerate(lens):
        q_len = cu[i + 1] - cu[i]
        if q_len == 0:
            continue
        gone = first_visible_key(context_len, q_len, window) // block_size
        stale += tables[i, :gone].tolist()
        tables[i, :gone] = poison
        changed += gone
    ids = torch.tensor(stale, device=k_cache.device)
    for cache in (k_cache, v_cache):
        if cache.dtype == FP8:
            cache.view(torch.uint8)[ids] = FP8_NAN_BYTE
        else:
            cache[ids] = float("nan")
    return changed


def reference_on_device(batch: dict, **variant) -> torch.Tensor:
    """The reference in float32 on the batch's own device (CUDA tests: their scores are too big
    for the host), returned on the CPU."""
    return reference.paged_attention(
        batch["q"].float(), batch["k_cache"].float(), batch["v_cache"].float(), batch["block_tables"],
        batch["seq_lens"], batch["cu_seqlens_q"], batch["scale"], **variant,
    ).cpu()  # fmt: skip


def fp8_batch(batch: dict, k_scale: float = 0.02, v_scale: float = 0.005) -> tuple[dict, dict]:
    """The batch over e4m3 caches (saturated as `write_kv` stores them) and the scales."""
    device = batch["q"].device
    ks, vs = torch.tensor([k_scale], device=device), torch.tensor([v_scale], device=device)
    k8 = (batch["k_cache"].float() / ks).clamp(-448, 448).to(FP8)
    v8 = (batch["v_cache"].float() / vs).clamp(-448, 448).to(FP8)
    return {**batch, "k_cache": k8, "v_cache": v8}, dict(k_scale=ks, v_scale=vs)


def fp8_reference(batch: dict, scales: dict, **variant) -> torch.Tensor:
    args = [batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q")]
    return reference.paged_attention(*args, batch["scale"], None, **scales, **variant).float().cpu()


# --------------------------------------------------------------------------------------------- #
# The reference's window and cap against an explicit mask (nobody's kernel)
# --------------------------------------------------------------------------------------------- #


def test_reference_window_and_cap_against_explicit_attention() -> None:
    """Dense float64 attention with the window written as a band mask and the cap as a tanh."""
    window, cap = 6, 1.5
    batch = make_batch([9, 1], [20, 13], 4, 2, 16, 8, torch.float32, device="cpu", seed=3)
    got = reference.paged_attention(**batch, sliding_window=window, soft_cap=cap)
    cu, lens = batch["cu_seqlens_q"].tolist(), batch["seq_lens"].tolist()
    for i, context_len in enumerate(lens):
        blocks = batch["block_tables"][i, : (context_len + 7) // 8].long()
        k = batch["k_cache"][blocks].flatten(0, 1)[:context_len].double().repeat_interleave(2, dim=1)
        v = batch["v_cache"][blocks].flatten(0, 1)[:context_len].double().repeat_interleave(2, dim=1)
        q = batch["q"][cu[i] : cu[i + 1]].double()
        q_pos = torch.arange(context_len - q.shape[0], context_len)[:, None]
        k_pos = torch.arange(context_len)[None, :]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
        scores = cap * torch.tanh(torch.einsum("qhd,khd->hqk", q, k) * batch["scale"] / cap)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        want = torch.einsum("hqk,khd->qhd", probs, v)
        torch.testing.assert_close(got[cu[i] : cu[i + 1]].double(), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------- #
# Triton against the reference
# --------------------------------------------------------------------------------------------- #


@needs_triton
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype, head_dim, num_q_heads, num_kv_heads, block_size", WINDOW_SHAPES)
def test_sliding_window_matches_reference(window, dtype, head_dim, num_q_heads, num_kv_heads, block_size):
    """A mixed batch (decodes, a chunk after cached context, a whole prompt, an idle sequence) and
    a decode batch (the split decode path), each with the window."""
    shape = (num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    mixed = make_batch(MIXED_Q_LENS, MIXED_CONTEXT, *shape, seed=window)
    run_both_ways(mixed, dtype, sliding_window=window)
    decode = make_batch([1] * len(DECODE_CONTEXT), DECODE_CONTEXT, *shape, seed=window + 1)
    run_both_ways(decode, dtype, sliding_window=window)


@needs_triton
def test_window_longer_than_every_context() -> None:
    """A window longer than every sequence but shorter than the table still runs the windowed
    kernels (and masks nothing); one at least as long as the table is dropped, so the result is
    the unwindowed kernels' exactly."""
    batch = make_batch(MIXED_Q_LENS, MIXED_CONTEXT, 8, 2, 64, 16, torch.float16, seed=4)
    table_tokens = batch["block_tables"].shape[1] * 16
    assert max(MIXED_CONTEXT) < 90 < table_tokens
    run_both_ways(batch, torch.float16, sliding_window=90)
    assert torch.equal(run_triton(batch, sliding_window=table_tokens), run_triton(batch))


@needs_triton
@pytest.mark.parametrize("window", [None, 23], ids=["cap-alone", "cap-and-window"])
@pytest.mark.parametrize("dtype, head_dim, num_q_heads, num_kv_heads, block_size", WINDOW_SHAPES)
def test_soft_cap_matches_reference(window, dtype, head_dim, num_q_heads, num_kv_heads, block_size):
    """Scores of a few units (q and k ~ N(0, 1), scaled up 4x) against a cap of 2: most are capped."""
    shape = (num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    batch = make_batch(MIXED_Q_LENS, MIXED_CONTEXT, *shape, seed=7)
    batch["scale"] *= 4
    run_both_ways(batch, dtype, soft_cap=2.0, sliding_window=window)
    decode = make_batch([1] * len(DECODE_CONTEXT), DECODE_CONTEXT, *shape, seed=8)
    decode["scale"] *= 4
    run_both_ways(decode, dtype, soft_cap=2.0, sliding_window=window)


@needs_triton
@pytest.mark.parametrize(
    "config, splits",
    [(None, None), (None, 1), (None, 3), ("looping", 2), ("single", 4)],
    ids=["default", "unsplit", "3-splits", "looping-splits", "single-tile-splits"],
)
@pytest.mark.parametrize("window", [7, 40, 130])
def test_windowed_decode_launch_variants(config, splits, window):
    """Every decode launch shape with a window: no split, splits over the window (each starting at
    the token's window), several tiles per split, one tile per split (its block ids loaded once the
    window is known); a long context and a short one, GQA 5:1."""
    kw = {"num_splits": splits}
    if config == "looping":
        kw["decode_config"] = ta.DecodeConfig(block_n=16, num_warps=4, num_stages=2)
    elif config == "single":
        kw["decode_config"] = ta.DecodeConfig(block_n=64, num_warps=4, num_stages=2)
    batch = make_batch([1, 1, 1], [300, 21, 131], 10, 2, 64, 16, torch.float16, seed=window)
    if config is not None:
        tables = batch["block_tables"]
        plan = ta.decode_plan(
            batch["q"], batch["k_cache"], tables, kw["decode_config"], splits, window=window
        )
        assert plan.meta["SINGLE_TILE"] == (config == "single" and plan.num_splits > 1)
    expected = reference_fp32(batch, sliding_window=window)
    assert_matches(run_triton(batch, sliding_window=window, **kw), expected, torch.float16)


@needs_triton
@pytest.mark.parametrize("window", [3, 20, 50])
def test_prefill_tiles_taller_than_the_window(window):
    """Query tiles of 64 tokens over key tiles of 16 (MHA, fp32): the later tokens of a tile see
    none of the first key tiles, whose running max stays -inf for them (no NaN may come of it);
    tall tiles and the default ones; chunks after cached context and a whole prompt."""
    batch = make_batch([150, 70, 1, 33], [150, 200, 40, 100], 2, 2, 32, 16, torch.float32, seed=window)
    expected = reference_fp32(batch, sliding_window=window)
    tall = ta.PrefillConfig(block_m=64, block_n=16, num_warps=4, num_stages=1)
    for config in (None, tall):
        assert_matches(
            run_triton(batch, sliding_window=window, prefill_config=config), expected, torch.float32
        )


@needs_triton
@pytest.mark.parametrize("window", [24, 40])
def test_chunked_prefill_across_the_window_edge(window):
    """A prompt of 90 prefilled in chunks of 20, 30 and 40 (bf16, GQA 4:1): each chunk's attention
    equals the reference's, the window's edge falling inside the chunks, and the chunks together
    equal the whole prompt's."""
    batch = make_batch([90], [90], 8, 2, 64, 16, torch.bfloat16, seed=window)
    whole = reference_fp32(batch, sliding_window=window)
    done = 0
    for chunk in (20, 30, 40):
        part = {
            **batch,
            "q": batch["q"][done : done + chunk],
            "seq_lens": torch.tensor([done + chunk], dtype=torch.int32, device=batch["q"].device),
            "cu_seqlens_q": torch.tensor([0, chunk], dtype=torch.int32, device=batch["q"].device),
        }
        got = run_triton(part, sliding_window=window)
        assert_matches(got, reference_fp32(part, sliding_window=window), torch.bfloat16)
        assert_matches(got, whole[done : done + chunk], torch.bfloat16)
        done += chunk


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("window", [5, 16, 37])
def test_out_of_window_blocks_are_never_read(window, fp8):
    """Blocks wholly before each sequence's window hold NaN, and so does the block their table
    entries now point to: decodes (split and not, one tile per split), chunks and prompts (default
    and tall tiles) stay finite and right."""
    dtype = torch.bfloat16
    batch = make_batch([1, 30, 1, 0, 45, 1], [200, 90, 64, 50, 45, 33], 8, 2, 64, 16, dtype, seed=window)
    scales = {}
    if fp8:
        batch, scales = fp8_batch(batch)
    assert poison_out_of_window(batch, window) > 5
    expected = fp8_reference(batch, scales, sliding_window=window)
    assert not expected.isnan().any()
    decodes = {**batch, "q": batch["q"][[0, 31, 77]], "cu_seqlens_q": torch.arange(4, dtype=torch.int32,
               device=batch["q"].device), "seq_lens": batch["seq_lens"][[0, 2, 5]],
               "block_tables": batch["block_tables"][[0, 2, 5]]}  # fmt: skip
    decode_expected = fp8_reference(decodes, scales, sliding_window=window)
    looping = ta.DecodeConfig(block_n=16, num_warps=4, num_stages=2)
    for kw in ({}, dict(num_splits=1), dict(decode_config=looping, num_splits=3)):
        assert_matches(run_triton(decodes, sliding_window=window, **scales, **kw), decode_expected, dtype)
    for kw in ({}, dict(prefill_config=ta.big_prefill_config())):
        assert_matches(run_triton(batch, sliding_window=window, **scales, **kw), expected, dtype)


@needs_triton
@pytest.mark.parametrize("window, cap", [(23, None), (None, 2.0), (23, 2.0)])
def test_fp8_caches_with_window_and_cap(window, cap):
    """FP8 caches: k_scale goes into the cap's pre-scale when there is a cap, into the exponent's
    scale when not; decodes and prefill chunks, GQA 3:1 and head_dim 80 (padded rows and columns)."""
    batch = make_batch([1, 9, 1, 1, 23], [300, 30, 3, 131, 23], 6, 2, 80, 16, torch.bfloat16, seed=9)
    batch["scale"] *= 4
    batch, scales = fp8_batch(batch)
    variant = dict(sliding_window=window, soft_cap=cap)
    expected = fp8_reference(batch, scales, **variant)
    for kw in ({}, dict(num_splits=4)):
        assert_matches(run_triton(batch, **scales, **variant, **kw), expected, torch.bfloat16)


# --------------------------------------------------------------------------------------------- #
# Launch choices (shapes only)
# --------------------------------------------------------------------------------------------- #


def test_window_that_cannot_exclude_a_key_is_dropped() -> None:
    assert ta.binding_window(None, 4096) is None
    assert ta.binding_window(4096, 4096) is None  # positions 0..4095 all see every earlier key
    assert ta.binding_window(1024, 4096) == 1024
    options = ta.score_options(0.125, 8192, None, 4096)
    assert options.window is None and not options.soft_cap
    capped = ta.score_options(0.125, 1024, 50.0, 4096)
    assert capped.window == 1024 and capped.soft_cap and capped.cap_scale == 0.125 / 50.0


def test_windowed_decode_is_launched_as_a_decode_over_the_window() -> None:
    """K1's (64, 4096) with a window of 1024 splits as (64, 1024) does; the table stays the
    bound of the block-id loads."""
    q = torch.empty(64, 32, 128, dtype=torch.bfloat16)
    k_cache = torch.empty(1, 16, 8, 128, dtype=torch.bfloat16)
    windowed = ta.decode_plan(q, k_cache, torch.empty(64, 4096 // 16, dtype=torch.int32), window=1024)
    short = ta.decode_plan(q, k_cache, torch.empty(64, 1024 // 16, dtype=torch.int32))
    assert (windowed.num_splits, windowed.tokens_per_split) == (short.num_splits, short.tokens_per_split)
    assert windowed.table_tokens == 4096 and windowed.meta["WINDOW"] and not short.meta["WINDOW"]
    one = ta.decode_plan(q[:1], k_cache, torch.empty(1, 4096 // 16, dtype=torch.int32), window=1000)
    assert one.num_splits * one.tokens_per_split >= 1000 > (one.num_splits - 1) * one.tokens_per_split


@needs_triton
@pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs the interpreter")
def test_dispatch_runs_triton_with_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kernels.paged_attention` no longer falls back to the reference for a window or a cap."""
    batch = make_batch([1, 9], [30, 9], 4, 2, 32, 16, torch.float32, device="cpu")
    variant = dict(sliding_window=6, soft_cap=3.0)
    expected = reference_fp32(batch, **variant)
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "triton")
    monkeypatch.setattr(reference, "paged_attention", None)  # would fail if called
    assert_matches(kernels.paged_attention(**batch, **variant), expected, torch.float32)


# --------------------------------------------------------------------------------------------- #
# CUDA only: realistic shapes, CUDA graphs, the FP8 routing
# --------------------------------------------------------------------------------------------- #

REALISTIC = [
    # num_q_heads, num_kv_heads, head_dim, window, soft_cap
    pytest.param(32, 8, 128, 4096, None, id="mistral-7b"),
    pytest.param(16, 8, 256, 1024, None, id="gemma3-12b-local"),
    pytest.param(16, 8, 256, 4096, 50.0, id="gemma2-9b-local-capped"),
    pytest.param(32, 16, 128, 4096, 50.0, id="gemma2-27b-local-capped"),
    pytest.param(32, 32, 128, 2048, None, id="mha-group1"),
    pytest.param(32, 4, 128, 1024, None, id="group8"),
]


@needs_cuda
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, window, cap", REALISTIC)
def test_cuda_windowed_attention_at_model_shapes(num_q_heads, num_kv_heads, head_dim, window, cap):
    """Long decodes (split over the window), a 512-token chunk crossing the window's edge after a
    long cached prefix, a whole prompt longer than the window, short sequences; the out-of-window
    blocks poisoned with NaN; then the decodes alone (the decode-only launch)."""
    q_lens = [1, 512, 1, 1, window + 300, 1]
    contexts = [window + 3000, window + 2500, 37, window * 2 + 5, window + 300, window - 1]
    batch = make_batch(q_lens, contexts, num_q_heads, num_kv_heads, head_dim, 16, torch.bfloat16, seed=1)
    batch["scale"] = 1.0 / 16 if cap else batch["scale"]
    assert poison_out_of_window(batch, window) > 100
    variant = dict(sliding_window=window, soft_cap=cap)
    assert_matches(run_triton(batch, **variant), reference_on_device(batch, **variant), torch.bfloat16)
    rows = [0, 513, 514, 515 + window + 300]
    seqs = [0, 2, 3, 5]
    decodes = {
        **batch,
        "q": batch["q"][rows],
        "seq_lens": batch["seq_lens"][seqs],
        "block_tables": batch["block_tables"][seqs],
        "cu_seqlens_q": torch.arange(len(seqs) + 1, dtype=torch.int32, device="cuda"),
    }
    assert_matches(run_triton(decodes, **variant), reference_on_device(decodes, **variant), torch.bfloat16)


@needs_cuda
def test_cuda_graph_capture_of_windowed_decode() -> None:
    """Captured once with a window and a cap; replays follow new lengths and tables (the window's
    start moves with each length)."""
    shape = dict(num_q_heads=16, num_kv_heads=8, head_dim=256, block_size=16, dtype=torch.bfloat16)
    variant = dict(sliding_window=200, soft_cap=30.0)
    batch = make_batch([1] * 4, [900, 20, 1, 377], **shape, num_blocks=256, extra_table_cols=40)
    out = torch.empty_like(batch["q"])
    ta.paged_attention(**batch, out=out, **variant)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.paged_attention(**batch, out=out, **variant)
    for step in range(3):
        fresh = make_batch([1] * 4, [700 + step, 2, 233, 1200], **shape, num_blocks=256, seed=10 + step)
        width = fresh["block_tables"].shape[1]
        assert width <= batch["block_tables"].shape[1]
        for key in ("k_cache", "v_cache", "seq_lens", "q"):
            batch[key].copy_(fresh[key])
        batch["block_tables"].zero_()
        batch["block_tables"][:, :width].copy_(fresh["block_tables"])
        out.fill_(float("nan"))
        graph.replay()
        assert_matches(out, reference_on_device(batch, **variant), torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("window, cap", [(1024, None), (None, 50.0), (None, None)])
def test_cuda_fp8_decode_routing(monkeypatch: pytest.MonkeyPatch, window, cap) -> None:
    """FP8 decodes with a window or a cap run the Triton FP8 kernel (the CUDA one has neither),
    those without keep the CUDA kernel where it applies; all match the reference."""
    launched = []
    original = cuda_decode.launch
    monkeypatch.setattr(cuda_decode, "launch", lambda *a, **k: launched.append(1) or original(*a, **k))
    batch = make_batch([1] * 8, [3000, 40, 1500, 1025, 7, 2048, 999, 1024], 32, 8, 128, 16, torch.bfloat16)
    batch, scales = fp8_batch(batch)
    if window:
        poison_out_of_window(batch, window)
    variant = dict(sliding_window=window, soft_cap=cap)
    assert_matches(
        run_triton(batch, **scales, **variant), fp8_reference(batch, scales, **variant), torch.bfloat16
    )
    plain = window is None and cap is None
    assert bool(launched) == (plain and cuda_decode.applies(
        batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"],
        batch["cu_seqlens_q"], batch["q"],
    ))  # fmt: skip
