"""BlockPool and KVCacheManager: exact block ids, hash chains, LRU eviction, ref counts."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.block_pool import BlockPool, FreeBlockQueue, hash_block_tokens
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.request import Request, SeqId


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def new_ids(spans) -> list[int] | None:
    """The ids allocate_slots handed out to a one-group model (None when it did not fit)."""
    if spans is None:
        return None
    assert len(spans) <= 1
    return spans[0][1] if spans else []


def make_request(seq_id: int, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(seq_id=SeqId(seq_id), prompt_token_ids=prompt, max_tokens=max_tokens)


# ---- hashing -------------------------------------------------------------------------------------


def test_hash_is_chained_and_deterministic() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(a, bytes)
    assert len(a) == 32
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    # The same tokens under a different parent are a different block.
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(a, [5, 6, 7, 8]) == hash_block_tokens(a, [5, 6, 7, 8])


# ---- free queue and pool -------------------------------------------------------------------------


def test_free_queue_push_pop_remove() -> None:
    pool = BlockPool(4)
    queue = FreeBlockQueue([])
    b0, b1, b2, b3 = pool.blocks
    for b in (b0, b1, b2):
        queue.append(b)
    queue.appendleft(b3)
    assert ids(queue) == [3, 0, 1, 2]
    queue.remove(b1)
    assert ids(queue) == [3, 0, 2]
    assert len(queue) == 3
    assert queue.popleft() is b3
    with pytest.raises(ValueError):
        queue.remove(b1)
    assert queue.popleft() is b0
    assert queue.popleft() is b2
    with pytest.raises(IndexError):
        queue.popleft()


def test_allocate_takes_from_the_head_in_order() -> None:
    pool = BlockPool(5)
    assert ids(pool.allocate(2)) == [0, 1]
    assert ids(pool.allocate(2)) == [2, 3]
    assert pool.num_free_blocks == 1
    assert pool.num_blocks_in_use == 4
    with pytest.raises(ValueError):
        pool.allocate(2)


def test_uncached_blocks_are_reused_before_cached_ones_and_cached_ones_lru() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    # Blocks 0, 1, 2 get hashes; 3, 4, 5 do not.
    for i in range(3):
        assert pool.cache_block(blocks[i], hash_block_tokens(None, [i]))
    pool.free([blocks[1], blocks[0], blocks[2], blocks[3], blocks[4]])
    # Uncached ones went to the head (last freed first), cached ones to the tail in free order.
    assert ids(pool.free_queue()) == [4, 3, 1, 0, 2]
    assert pool.num_cached_free_blocks == 3
    # Allocation uses the uncached ones first, then evicts the least recently freed cached one.
    assert ids(pool.allocate(3)) == [4, 3, 1]
    assert pool.get_cached_block(hash_block_tokens(None, [1])) is None  # evicted and unmapped
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(hash_block_tokens(None, [0])) is blocks[0]
    assert pool.num_cached_free_blocks == 2
    assert pool.num_cached_blocks == 2


def test_cached_free_blocks_ahead_are_the_cached_ones_allocate_would_evict_next() -> None:
    """What the CPU tier offloads ahead of eviction: the cached blocks among the next n handed out."""
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    for i in range(3):
        pool.cache_block(blocks[i], hash_block_tokens(None, [i]))
    pool.free([blocks[1], blocks[0], blocks[2], blocks[3], blocks[4]])  # queue: 4, 3, 1, 0, 2
    assert ids(pool.cached_free_blocks_ahead(2)) == []  # two uncached blocks come first
    assert ids(pool.cached_free_blocks_ahead(4)) == [1, 0]
    assert ids(pool.cached_free_blocks_ahead(10)) == [1, 0, 2]
    assert ids(pool.cached_free_blocks_ahead(4)) == ids(b for b in pool.allocate(4) if b.block_id < 3)


def test_touch_revives_a_cached_free_block_and_ref_counts_sharing() -> None:
    pool = BlockPool(3)
    (b0,) = pool.allocate(1)
    h = hash_block_tokens(None, [7, 7])
    assert pool.cache_block(b0, h)
    pool.touch([b0])  # a second holder shares it
    assert b0.ref_count == 2
    pool.free([b0])
    assert b0.ref_count == 1
    assert pool.num_free_blocks == 2
    pool.free([b0])
    assert b0.ref_count == 0
    assert ids(pool.free_queue()) == [1, 2, 0]
    pool.touch([b0])  # prefix hit on a cached free block
    assert b0.ref_count == 1
    assert ids(pool.free_queue()) == [1, 2]
    assert pool.num_cached_free_blocks == 0
    with pytest.raises(ValueError):
        pool.free([pool.blocks[1]])  # never held


def test_cache_block_keeps_the_first_copy_and_respects_disabled_caching() -> None:
    pool = BlockPool(3)
    b0, b1 = pool.allocate(2)
    h = hash_block_tokens(None, [1])
    assert pool.cache_block(b0, h)
    assert not pool.cache_block(b1, h)  # duplicate content computed twice: first copy stays canonical
    assert b1.block_hash is None
    assert pool.get_cached_block(h) is b0
    assert not pool.cache_block(b0, hash_block_tokens(None, [2]))  # already hashed
    off = BlockPool(2, enable_caching=False)
    (c0,) = off.allocate(1)
    assert not off.cache_block(c0, h)
    assert c0.block_hash is None


# ---- KV cache manager ----------------------------------------------------------------------------


def test_allocate_slots_grows_the_table_block_by_block() -> None:
    kv = KVCacheManager(block_size=4, num_gpu_blocks=4)
    req = make_request(1, list(range(6)))
    assert new_ids(kv.allocate_slots(req, 6)) == [0, 1]
    req.num_computed_tokens = 6
    assert new_ids(kv.allocate_slots(req, 7)) == []  # still fits in block 1
    assert new_ids(kv.allocate_slots(req, 9)) == [2]
    assert new_ids(kv.allocate_slots(req, 17)) is None  # 5 blocks > 4: nothing changes
    assert kv.block_ids(req.seq_id) == [0, 1, 2]
    assert kv.block_pool.num_free_blocks == 1


def test_prefix_hit_reuses_the_hash_chain_and_shares_blocks() -> None:
    kv = KVCacheManager(block_size=4, num_gpu_blocks=8)
    a = make_request(1, list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    assert new_ids(kv.allocate_slots(a, 10)) == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)  # two full blocks get hashes; the partial one does not
    assert kv.block_pool.num_cached_blocks == 2

    b = make_request(2, [*range(8), 99, 98, 97])  # same first two blocks, different tail
    hits = kv.get_computed_blocks(b)
    num_cached = hits.num_tokens
    assert ids(hits.tables[0]) == [0, 1]
    assert num_cached == 8
    assert new_ids(kv.allocate_slots(b, 11, hits)) == [3]
    assert kv.block_ids(b.seq_id) == [0, 1, 3]
    assert [blk.ref_count for blk in kv.block_pool.blocks[:4]] == [2, 2, 1, 1]

    c = make_request(3, [0, 1, 2, 3, 9, 9, 9, 9, 9])  # diverges in the second block
    hits = kv.get_computed_blocks(c)
    num_cached = hits.num_tokens
    assert ids(hits.tables[0]) == [0]
    assert num_cached == 4

    d = make_request(4, [5, *range(1, 8)])  # same second block, different first: chain breaks
    assert kv.get_computed_blocks(d).num_tokens == 0


def test_at_least_one_token_is_computed_when_the_whole_prompt_is_cached() -> None:
    kv = KVCacheManager(block_size=4, num_gpu_blocks=8)
    a = make_request(1, list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    b = make_request(2, list(range(8)))  # the same 8 tokens: the last block is recomputed
    hits = kv.get_computed_blocks(b)
    num_cached = hits.num_tokens
    assert ids(hits.tables[0]) == [0]
    assert num_cached == 4
    assert new_ids(kv.allocate_slots(b, 8, hits)) == [2]
    c = make_request(3, list(range(9)))  # one more token: both full blocks are reused
    hits = kv.get_computed_blocks(c)
    num_cached = hits.num_tokens
    assert ids(hits.tables[0]) == [0, 1]
    assert num_cached == 8


def test_only_known_computed_tokens_are_cached() -> None:
    kv = KVCacheManager(block_size=4, num_gpu_blocks=8)
    a = make_request(1, list(range(6)))
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 3  # a chunk: block 0 not full of computed tokens yet
    kv.cache_full_blocks(a)
    assert kv.block_pool.num_cached_blocks == 0
    a.num_computed_tokens = 6
    kv.cache_full_blocks(a)
    assert kv.block_pool.num_cached_blocks == 1
    # Outputs pending (values unknown): the block they fill is not hashed until they arrive.
    a.num_pending_outputs = 1
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8  # position 6 is known? no: known = 6, two tokens computed beyond
    kv.cache_full_blocks(a)
    assert kv.block_pool.num_cached_blocks == 1
    a.output_token_ids += [40, 41]
    a.num_pending_outputs = 0
    kv.cache_full_blocks(a)
    assert kv.block_pool.num_cached_blocks == 2


def test_free_keeps_full_blocks_cached_and_evicts_the_chain_tail_first() -> None:
    kv = KVCacheManager(block_size=2, num_gpu_blocks=6)
    a = make_request(1, [1, 2, 3, 4, 5, 6, 7])
    kv.allocate_slots(a, 7)
    a.num_computed_tokens = 7
    kv.free(a)
    # Block 3 (partial, uncached) goes to the head; the chain 0, 1, 2 goes to the tail reversed.
    assert ids(kv.block_pool.free_queue()) == [3, 4, 5, 2, 1, 0]
    assert kv.block_pool.num_cached_free_blocks == 3
    assert kv.block_pool.num_blocks_in_use == 0
    b = make_request(2, [9] * 8)
    assert new_ids(kv.allocate_slots(b, 8)) == [3, 4, 5, 2]  # evicts the chain's last block first
    c = make_request(3, [1, 2, 3, 4, 0])
    hits = kv.get_computed_blocks(c)
    num_cached = hits.num_tokens
    assert ids(hits.tables[0]) == [0, 1]
    assert num_cached == 4


def test_allocate_counts_cached_free_hits_against_the_free_blocks() -> None:
    kv = KVCacheManager(block_size=2, num_gpu_blocks=3)
    a = make_request(1, [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.free(a)  # blocks 0, 1 cached free, block 2 free
    b = make_request(2, [1, 2, 3, 4, 5, 6, 7])  # 2 hits + needs 2 more blocks, only 1 left
    hits = kv.get_computed_blocks(b)
    assert ids(hits.tables[0]) == [0, 1]
    assert new_ids(kv.allocate_slots(b, 7, hits)) is None
    assert [blk.ref_count for blk in kv.block_pool.blocks] == [0, 0, 0]  # untouched
    assert new_ids(kv.allocate_slots(b, 5, hits)) == [2]


def test_swap_out_and_in_with_deferred_cpu_release() -> None:
    kv = KVCacheManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=3)
    a = make_request(1, [1, 2, 3])
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    assert kv.swap_out(a) == [(0, 0), (1, 1)]
    assert kv.block_ids(a.seq_id) == []
    assert kv.cpu_block_ids(a.seq_id) == [0, 1]
    assert kv.block_pool.num_blocks_in_use == 0
    assert kv.num_free_cpu_blocks == 1
    b = make_request(2, [5, 6, 7, 8, 9])
    kv.allocate_slots(b, 5)
    b.num_computed_tokens = 5
    assert kv.swap_out(b) is None  # 3 blocks, 1 CPU block free: nothing changes
    # a's partial block 1 was freed uncached (head), its full block 0 stayed cached (tail).
    assert kv.block_ids(b.seq_id) == [1, 2, 3]
    kv.free(b)  # free queue: 3 (partial, head), 0, then b's cached chain 2, 1
    assert ids(kv.block_pool.free_queue()) == [3, 0, 2, 1]
    assert kv.swap_in(a, 4) == [(0, 3), (1, 0)]
    assert kv.block_ids(a.seq_id) == [3, 0]
    # The CPU blocks it read are released only after the step (swap_out runs before swap_in).
    assert kv.num_free_cpu_blocks == 1
    kv.end_step()
    assert kv.num_free_cpu_blocks == 3


def test_blocks_short_and_reclaimable_count_only_what_release_would_free() -> None:
    kv = KVCacheManager(block_size=2, num_gpu_blocks=6, num_cpu_blocks=4)
    a = make_request(1, [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)  # blocks 0, 1 cached
    b = make_request(2, [1, 2, 3, 4, 9])
    hits = kv.get_computed_blocks(b)
    assert ids(hits.tables[0]) == [0, 1]
    kv.allocate_slots(b, 5, hits)  # shares 0, 1 with a and takes 3; blocks 4, 5 are free
    assert kv.num_blocks_short(a, 9) == 0
    assert kv.num_blocks_short(a, 11) == 1
    assert kv.num_reclaimable_blocks([a.seq_id]) == 1  # its block 2; 0 and 1 are shared with b
    assert kv.num_reclaimable_blocks([a.seq_id, b.seq_id]) == 4
    assert kv.num_reclaimable_blocks([a.seq_id, b.seq_id], keep=hits) == 2  # hits stay with their taker
    c = make_request(3, [1, 2, 3, 4, 7, 7, 7, 7, 7])
    c_hits = kv.get_computed_blocks(c)
    assert kv.num_blocks_short(c, 9, c_hits) == 1  # 3 new blocks beyond the 2 hits, 2 free
    b.num_computed_tokens = 5
    assert kv.swap_out(b) == [(0, 0), (1, 1), (3, 2)]
    # Swapped out, b needs a whole new table: 4 blocks for 7 tokens, with 3, 4, 5 free.
    assert kv.num_blocks_short(b, 5) == 0
    assert kv.num_blocks_short(b, 7) == 1
