"""The prefix cache's CPU tier (scheduler.kv_tier, --kv-offloading-size): which blocks the scheduler
offloads and loads (exact block ids), one host pool for the tier and the swap pool, and a block
loaded back bit for bit through the executor's own runner. End to end through real services:
tests/test_kv_tier_e2e.py."""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.runner import ModelRunner
from pagedserve.protos import executor_pb2
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.core import Scheduler
from pagedserve.scheduler.kv_cache_manager import CpuBlock, KVCacheManager
from pagedserve.scheduler.kv_tier import CpuTier
from pagedserve.scheduler.request import Request, SamplingOptions, SeqId

BS = 4


def _request(seq_id: int, prompt: list[int]) -> Request:
    return Request(SeqId(seq_id), prompt, max_tokens=4, sampling=SamplingOptions())


def _compute(kv: KVCacheManager, request: Request) -> list:
    """Admits `request` on its hit, as the scheduler does (all of it computed), and returns the
    allocation's new blocks."""
    hit = kv.get_computed_blocks(request)
    spans = kv.allocate_slots(request, request.num_tokens, hit)
    assert spans is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return hit


def test_evicted_cached_blocks_go_to_the_tier_and_come_back_as_loads():
    kv = KVCacheManager(BS, num_gpu_blocks=4, num_cpu_blocks=8, num_cpu_offload_blocks=6)
    a = _request(1, list(range(100, 113)))  # 13 tokens: 3 full blocks and one more
    _compute(kv, a)
    kv.free(a)  # 3 cached free blocks (0, 1, 2) and block 3 free
    assert kv.take_tier_moves() == ([], [])
    b = _request(2, list(range(200, 216)))  # 16 tokens: every block, so a's chain is evicted
    _compute(kv, b)
    offloads, loads = kv.take_tier_moves()
    # Evicted tail first (a's chain was freed last block first), each to a host block of its own.
    assert offloads == [(2, 0), (1, 1), (0, 2)] and loads == []
    assert kv.num_offloaded_blocks == 3 and len(kv.tier) == 3
    kv.end_step()
    kv.free(b)
    # a's prompt again: the GPU pool has none of it, the tier all three full blocks.
    again = _request(3, list(range(100, 113)))
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 12 and hit.num_cpu_blocks == 3
    assert all(isinstance(b, CpuBlock) for b in hit.tables[0])
    spans = kv.allocate_slots(again, again.num_tokens, hit)
    offloads, loads = kv.take_tier_moves()
    assert [cpu for cpu, _ in loads] == [2, 1, 0]  # host blocks of positions 0, 1, 2
    gpu_ids = kv.block_ids(again.seq_id)
    assert [gpu for _, gpu in loads] == gpu_ids[:3] and spans == [(3, gpu_ids[3:])]
    # b's 4 full blocks, evicted for these, go to the tier too, which holds 6 at most: 3 fit, and
    # the 4th is dropped rather than take a host block this very step reads (a's) or writes.
    assert len(offloads) == 3 and len(kv.tier) == 6
    # The loaded blocks are in the GPU prefix cache at once: a request admitted after finds them.
    twin = _request(4, list(range(100, 113)))
    assert kv.get_computed_blocks(twin).num_cpu_blocks == 0
    assert kv.get_computed_blocks(twin).num_tokens == 12


def test_the_tier_evicts_least_recently_used_and_never_a_block_this_step_moves():
    tier = CpuTier(3)
    for slot, name in enumerate(b"abc"):
        tier.insert((0, bytes([name])), slot)
    tier.touch((0, b"a"))  # order now b, c, a
    assert tier.evict() == 1  # b
    assert tier.evict(keep=[2]) == 0  # c's block is busy: a goes
    assert tier.evict(keep=[2]) is None
    with pytest.raises(ValueError):
        CpuTier(0)


def test_swap_and_tier_share_one_host_pool_and_swap_takes_the_tiers_blocks():
    """4 host blocks for both: the tier fills them with evicted blocks; a swap-out takes them back
    (a pre-empted request's KV before a cached prefix); with none left, it changes nothing."""
    kv = KVCacheManager(BS, num_gpu_blocks=8, num_cpu_blocks=4, num_cpu_offload_blocks=4)
    a, b, c = (_request(i, list(range(100 * i, 100 * i + 16))) for i in (1, 2, 3))  # 4 blocks each
    _compute(kv, a)
    kv.free(a)  # blocks 0-3 cached free, behind the never used 4-7
    _compute(kv, b)  # takes 4-7: nothing evicted
    assert kv.take_tier_moves() == ([], [])
    _compute(kv, c)  # evicts a's chain into the tier
    offloads, _ = kv.take_tier_moves()
    kv.end_step()
    assert sorted(cpu for _, cpu in offloads) == [0, 1, 2, 3]
    assert len(kv.tier) == 4 and kv.num_free_cpu_blocks == 0
    moves = kv.swap_out(b)
    assert moves is not None and sorted(cpu for _, cpu in moves) == [0, 1, 2, 3]
    assert len(kv.tier) == 0, "the swap-out took the tier's blocks"
    kv.end_step()
    assert kv.swap_out(c) is None  # no host block left: it pre-empts by recompute instead
    assert kv.num_blocks(c.seq_id) == 4


def test_a_tier_of_size_zero_or_without_prefix_caching_is_no_tier():
    assert KVCacheManager(BS, 8, num_cpu_blocks=4).tier is None
    assert (
        KVCacheManager(BS, 8, num_cpu_blocks=4, enable_prefix_caching=False, num_cpu_offload_blocks=4).tier
        is None
    )
    with pytest.raises(ValueError, match="exceeds the host pool"):
        KVCacheManager(BS, 8, num_cpu_blocks=2, num_cpu_offload_blocks=4)
    with pytest.raises(ValueError, match="num_cpu_offload_blocks"):
        SchedulerConfig(num_gpu_blocks=8, max_model_len=16, num_cpu_blocks=1, num_cpu_offload_blocks=2)


def test_the_scheduler_plans_tier_moves_as_swap_moves_and_counts_cpu_hits():
    config = SchedulerConfig(
        block_size=BS, num_gpu_blocks=6, num_cpu_blocks=8, num_cpu_offload_blocks=8, max_model_len=24
    )
    s = Scheduler(config)

    def run_to_end(seq_id: int, prompt: list[int]):
        request = _request(seq_id, prompt)
        request.max_tokens = 1
        s.add_request(request)
        plan = s.schedule()
        s.process_output(plan.step_id, plan.sampling_seq_ids, [7] * len(plan.sampling_seq_ids))
        s.schedule()  # flushes the removal
        return request, plan

    first, _ = run_to_end(1, list(range(100, 117)))
    _, evicting = run_to_end(2, list(range(200, 221)))
    assert evicting.swap_out and all(cpu < 8 for _, cpu in evicting.swap_out)
    again, loading = run_to_end(3, list(range(100, 117)))
    assert loading.swap_in and again.num_cached_prompt_tokens == 16
    assert again.num_cpu_cached_prompt_tokens > 0
    stats = s.stats
    assert stats.kv_offloaded_blocks >= len(evicting.swap_out)
    assert stats.kv_loaded_blocks == len(loading.swap_in)
    assert stats.cpu_prefix_cache_hit_tokens == again.num_cpu_cached_prompt_tokens
    assert stats.cpu_tier_capacity_blocks == 8 and 0 < stats.cpu_tier_blocks <= 8


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner.create(
        ExecutorConfig(
            model=str(tiny_model_dir),
            device="cpu",
            num_gpu_blocks_override=16,
            swap_space=0.0,
            kv_offloading_size=0.001,
            max_model_len=128,
        )  # fmt: skip
    )


def test_a_block_loaded_from_the_tier_is_the_block_that_was_evicted(runner):
    """Through the executor's own plan path: a prompt's KV, offloaded (swap_out) to a host block
    and loaded (swap_in) into another GPU block, is bit for bit what was computed."""
    assert (
        runner.num_cpu_offload_blocks > 0 and runner.kv_cache.num_cpu_blocks == runner.num_cpu_offload_blocks
    )
    runner.reset()
    prompt = list(range(5, 37))  # two full blocks of 16
    table = executor_pb2.BlockTable(block_ids=[3, 4, 5])
    runner.execute(executor_pb2.StepPlan(new_requests=[
        executor_pb2.NewRequest(seq_id=1, token_ids=prompt, num_new_tokens=len(prompt), block_tables=[table])
    ]))  # fmt: skip
    pool = runner.kv_cache.device_pool
    computed = pool[:, :, [3, 4]].clone()
    runner.execute(
        executor_pb2.StepPlan(
            removed_seq_ids=[1],
            swap_out=[executor_pb2.BlockMove(src=3, dst=0), executor_pb2.BlockMove(src=4, dst=1)],
        )
    )
    pool[:, :, [3, 4]] = torch.nan  # the GPU blocks are reused
    runner.execute(
        executor_pb2.StepPlan(
            swap_in=[executor_pb2.BlockMove(src=0, dst=9), executor_pb2.BlockMove(src=1, dst=11)]
        )
    )
    loaded = pool[:, :, [9, 11]]
    assert torch.equal(loaded.view(torch.uint8), computed.view(torch.uint8))


def test_an_executor_refuses_a_host_pool_the_machine_cannot_hold(tiny_model_dir):
    from pagedserve.executor.kv_cache import HostPoolError

    with pytest.raises(HostPoolError, match="--kv-offloading-size"):
        ModelRunner.create(
            ExecutorConfig(model=str(tiny_model_dir), device="cpu", num_gpu_blocks_override=16,
                           kv_offloading_size=1e9, max_model_len=128)
        )  # fmt: skip
