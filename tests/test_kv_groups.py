"""KV-cache groups: layers grouped by attention kind (executor.kv_groups), and the scheduler's block
tables per group releasing what a sliding window can no longer reach (scheduler.kv_cache_manager)."""

from __future__ import annotations

import pytest

from pagedserve.common.kv_sizing import blocks_per_sequence
from pagedserve.executor.kv_groups import KVCacheGroups
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.request import Request, SeqId

BS = 16


def test_one_kind_of_layer_is_one_group_of_every_layer():
    groups = KVCacheGroups.for_layers([None] * 32)
    assert groups.sliding_windows == (None,)
    assert groups.layers_per_block == 32
    assert groups.layer_slot == tuple(range(32))
    assert KVCacheGroups.for_layers([4096] * 4).sliding_windows == (4096,)  # Mistral: all sliding


def test_gemma3_shape_five_local_per_global_layer():
    """48 layers, every 6th global: 8 global and 40 local layers make 6 groups of 8 (1 full, 5
    sliding), so a block holds 8 layers: a sixth of a full-attention block."""
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(48)]
    groups = KVCacheGroups.for_layers(windows)
    assert groups.sliding_windows == (None, 1024, 1024, 1024, 1024, 1024)
    assert groups.layers_per_block == 8
    assert [groups.layer_group[i] for i in (5, 11, 47)] == [0, 0, 0]
    assert [groups.layer_slot[i] for i in (5, 11, 47)] == [0, 1, 7]
    assert groups.layer_group[0] == 1 and groups.layer_group[46] == 5
    for layer, window in enumerate(windows):
        assert groups.layer_window(layer) == window
    # Each (group, slot) holds exactly one layer: no two layers share KV memory.
    assert len(set(zip(groups.layer_group, groups.layer_slot, strict=True))) == 48
    assert [(g.sliding_window, g.num_layers) for g in groups.to_proto()] == [(0, 8)] + [(1024, 8)] * 5


def test_uneven_kinds_leave_the_last_group_short():
    """Gemma 3 1B: 26 layers, 4 global: groups of 4, the local layers' last group holds 2."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = KVCacheGroups.for_layers(windows)
    assert groups.layers_per_block == 4
    assert groups.sliding_windows == (None, *([512] * 6))
    assert [g.num_layers for g in groups.to_proto()] == [4, 4, 4, 4, 4, 4, 2]


def _request(seq_id: int, prompt: list[int]) -> Request:
    return Request(seq_id=SeqId(seq_id), prompt_token_ids=prompt, max_tokens=10_000)


def _decode(kv: KVCacheManager, request: Request, steps: int, check) -> None:
    """Grows the request one token a step, as decoding does, calling check() after each step."""
    for _ in range(steps):
        request.output_token_ids.append(7)
        assert kv.allocate_slots(request, request.num_tokens) is not None
        request.num_computed_tokens = request.num_tokens
        kv.cache_full_blocks(request)
        check()


@pytest.mark.parametrize("window", [1, 15, 16, 17, 32, 100])
def test_sliding_group_blocks_stay_bounded_while_the_sequence_grows_past_the_window(window):
    """A full group grows with the sequence; a sliding group holds at most window / block_size + 2
    blocks however long it gets, and its released blocks go back to the pool."""
    kv = KVCacheManager(BS, 200, sliding_windows=(None, window))
    request = _request(1, list(range(40)))
    assert kv.allocate_slots(request, 40) is not None
    request.num_computed_tokens = 40
    bound = window // BS + 2

    def check() -> None:
        held = [b for b in kv.blocks(request.seq_id, 1) if b is not None]
        assert len(held) <= bound
        # It holds exactly the blocks the last step's query (at the position before the end) saw.
        first = max(0, request.num_computed_tokens - 1 - window + 1) // BS
        held_entries = [i for i, b in enumerate(kv.blocks(request.seq_id, 1)) if b is not None]
        assert held_entries == list(range(first, -(-request.num_computed_tokens // BS)))
        assert len(kv.blocks(request.seq_id, 0)) == -(-request.num_computed_tokens // BS)
        assert kv.block_pool.num_blocks_in_use == kv.num_blocks(request.seq_id)

    _decode(kv, request, 600, check)
    assert kv.num_blocks(request.seq_id) <= -(-640 // BS) + bound
    kv.free(request)
    assert kv.block_pool.num_blocks_in_use == 0


def test_a_prefix_hit_needs_only_the_blocks_the_window_reaches():
    kv = KVCacheManager(BS, 64, sliding_windows=(None, 20))
    prompt = list(range(100, 196))  # 96 tokens: 6 blocks
    a = _request(1, prompt)
    kv.allocate_slots(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(a)
    b = _request(2, [*prompt, 5])  # the same 96 tokens, then one more: 6 full blocks can hit
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 96
    full, sliding = hit.tables
    assert [blk.block_id for blk in full] == kv.block_ids(a.seq_id, 0)
    # At position 96 a window of 20 sees positions 77..95: blocks 4 and 5 only.
    assert sliding[:4] == (None,) * 4
    assert [blk.block_id for blk in sliding[4:]] == kv.block_ids(a.seq_id, 1)[4:]
    assert kv.allocate_slots(b, 97, hit) == [(6, [12]), (6, [13])]
    assert kv.block_tables(b.seq_id) == [(0, [*kv.block_ids(a.seq_id, 0), 12]), (4, [10, 11, 13])]

    # Without the sliding group's last blocks the hit shrinks to where the window is cached.
    kv.free(a)
    kv.free(b)
    block_5 = kv.block_pool.get_cached_block(kv.prompt_block_hashes(b.all_token_ids)[5], group=1)
    kv.block_pool.touch([block_5])  # taken by someone else and reused: its hash is gone
    kv.block_pool.free([block_5])
    assert kv.block_pool.allocate(kv.block_pool.num_free_blocks)  # evicts everything cached
    c = _request(3, [*prompt, 5])
    assert kv.get_computed_blocks(c).num_tokens == 0


def test_swap_out_copies_only_what_the_window_reaches():
    kv = KVCacheManager(BS, 64, num_cpu_blocks=16, sliding_windows=(None, 20))
    a = _request(1, list(range(96)))
    kv.allocate_slots(a, 96)
    a.num_computed_tokens = 96
    moves = kv.swap_out(a)
    assert len(moves) == 6 + 2  # every block of the full group, blocks 4 and 5 of the sliding one
    assert kv.block_pool.num_blocks_in_use == 0
    a.output_token_ids.append(3)
    assert len(kv.swap_in(a, 97)) == 8
    assert [first for first, _ in kv.block_tables(a.seq_id)] == [0, 4]
    assert [len(ids) for _, ids in kv.block_tables(a.seq_id)] == [7, 3]


def test_one_sequence_needs_its_window_plus_a_chunk_per_sliding_group():
    assert blocks_per_sequence(8192, 16, (None,)) == 512
    # Gemma 3: 1 full + 5 sliding groups of window 1024, decoding: 512 + 5 * 65 blocks.
    assert blocks_per_sequence(8192, 16, (None, *([1024] * 5)), chunk=1) == 512 + 5 * 65
    # A 2,048-token prefill chunk: the window and the chunk.
    assert blocks_per_sequence(8192, 16, (None, 1024), chunk=2048) == 512 + 193
    assert blocks_per_sequence(100, 16, (1024,)) == 7  # a short sequence never exceeds its length
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        SchedulerConfig(num_gpu_blocks=600, max_model_len=8192, sliding_windows=(None, 1024), block_size=16)
    SchedulerConfig(
        num_gpu_blocks=600, max_model_len=8192, sliding_windows=(None, 1024), max_num_batched_tokens=256
    )
