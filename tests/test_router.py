"""The router's cost function, its bound against a hot prefix, and the exact prefix-hit lookup."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.request import Request, SeqId
from pagedserve.scheduler.router import (
    DECODE_TOKEN_WEIGHT,
    HOT_LOAD_MARGIN,
    ExecutorLoad,
    Router,
    cost,
)

BS = 16


def idle(hit_blocks: int = 0, free: int = 100) -> ExecutorLoad:
    return ExecutorLoad(
        num_running=0,
        num_waiting=0,
        queued_tokens=0,
        num_free_blocks=free,
        block_size=BS,
        hit_blocks=hit_blocks,
    )


def busy(running: int, waiting: int = 0, queued: int = 0, hit_blocks: int = 0) -> ExecutorLoad:
    return ExecutorLoad(running, waiting, queued, num_free_blocks=100, block_size=BS, hit_blocks=hit_blocks)


def test_cost_counts_prefill_queue_decodes_and_missing_blocks():
    assert cost(100, idle()) == 100
    assert cost(100, idle(hit_blocks=4)) == 100 - 4 * BS
    assert cost(100, busy(running=3, waiting=1, queued=50)) == 100 + 50 + 3 * DECODE_TOKEN_WEIGHT
    # 100 tokens + 1 to sample need 7 blocks; with 2 free, 5 blocks' worth of tokens wait.
    assert cost(100, idle(free=2)) == 100 + 5 * BS
    assert cost(100, idle(hit_blocks=4), use_hit=False) == 100
    # A miss where another executor holds 4 blocks: those blocks would be computed a second time.
    assert cost(100, idle(), max_hit=4) == 100 + 4 * BS
    assert cost(100, idle(hit_blocks=4), max_hit=4) == 100 - 4 * BS


def test_prefix_policy_goes_where_the_prefix_is_cached():
    router = Router("prefix")
    for _ in range(5):  # whatever the round-robin position
        assert router.choose(200, [idle(), idle(hit_blocks=10), idle(hit_blocks=3)]) == 1


def test_a_hit_is_weighed_against_load():
    router = Router("prefix")
    # A one-block hit is worth two running requests (it saves the wait, and the pool's work):
    # one more running request does not outweigh it, three more do.
    for _ in range(2):  # whatever the round-robin position
        assert router.choose(64, [busy(running=2, hit_blocks=1), busy(running=1)]) == 0
        assert router.choose(64, [busy(running=4, hit_blocks=1), busy(running=1)]) == 1
    # A long hit wins over a few running requests.
    assert router.choose(640, [busy(running=3, hit_blocks=30), busy(running=1)]) == 0


def test_hot_prefix_bound_stops_piling_on_one_executor():
    """Every request shares a prefix cached on executor 0: it takes them while its load is within
    the bound, then the others get them even though their hit is zero."""
    router = Router("prefix")
    loads = [[0, 0], [0, 0], [0, 0]]  # [running, waiting] per executor
    chosen = []
    for _ in range(30):
        executors = [
            ExecutorLoad(
                r, w, queued_tokens=0, num_free_blocks=1000, block_size=BS, hit_blocks=50 if i == 0 else 0
            )
            for i, (r, w) in enumerate(loads)
        ]
        i = router.choose(60 * BS, executors)
        chosen.append(i)
        loads[i][0] += 1
    assert chosen[: HOT_LOAD_MARGIN + 1] == [0] * (HOT_LOAD_MARGIN + 1)
    assert {1, 2} <= set(chosen)
    running = [r for r, _ in loads]
    assert max(running) <= 1.5 * min(running) + HOT_LOAD_MARGIN + 1


def test_ties_are_broken_round_robin_and_round_robin_ignores_everything():
    router = Router("prefix")
    assert [router.choose(10, [idle(), idle(), idle()]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    rr = Router("round_robin")
    assert [rr.choose(10, [idle(hit_blocks=9), busy(50), idle()]) for _ in range(4)] == [0, 1, 2, 0]


def test_least_loaded_ignores_the_cache():
    router = Router("least_loaded")
    assert router.choose(320, [busy(running=2, hit_blocks=19), busy(running=1)]) == 1


def test_router_refuses_bad_input():
    with pytest.raises(ValueError, match="routing policy"):
        Router("random")
    with pytest.raises(ValueError, match="no executor"):
        Router().choose(10, [])


def test_exact_hit_lookup_does_not_touch_the_pool():
    """num_cached_blocks sees exactly the full blocks a later admission would reuse, and changes
    neither ref counts nor the free queue's (LRU) order."""
    manager = KVCacheManager(BS, num_gpu_blocks=16)
    prompt = list(range(3, 3 + 4 * BS + 5))  # 4 full blocks and a partial one
    request = Request(SeqId(1), prompt, max_tokens=4)
    assert manager.allocate_slots(request, len(prompt)) is not None
    request.num_computed_tokens = len(prompt)
    manager.free(request)  # full blocks stay cached, in the free queue
    queue_before = [b.block_id for b in manager.block_pool.free_queue()]
    refs_before = [b.ref_count for b in manager.block_pool.blocks]

    hashes = manager.prompt_block_hashes(prompt)
    assert len(hashes) == 4
    assert manager.num_cached_blocks(hashes) == 4
    other = prompt[: 2 * BS] + [1] * (2 * BS + 5)  # shares two blocks
    assert manager.num_cached_blocks(manager.prompt_block_hashes(other)) == 2
    assert manager.num_cached_blocks(manager.prompt_block_hashes([1] * 70)) == 0
    # The same figure admission would get.
    probe = Request(SeqId(2), other, max_tokens=4)
    assert manager.get_computed_blocks(probe).num_tokens == 2 * BS
    assert [b.block_id for b in manager.block_pool.free_queue()] == queue_before
    assert [b.ref_count for b in manager.block_pool.blocks] == refs_before
    assert KVCacheManager(BS, 16, enable_prefix_caching=False).num_cached_blocks(hashes) == 0
