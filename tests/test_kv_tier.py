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
from pagedserve.scheduler.core import Scheduler, StepPlan
from pagedserve.scheduler.kv_cache_manager import CpuBlock, KVCacheManager
from pagedserve.scheduler.kv_tier import TierIndex, load_budget
from pagedserve.scheduler.request import Request, RequestStatus, SamplingOptions, SeqId

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
    tier = TierIndex(3)
    for slot, name in enumerate(b"abc"):
        tier.insert((0, bytes([name])), slot)
    tier.touch((0, b"a"))  # order now b, c, a
    assert tier.evict() == ((0, b"b"), 1)
    assert tier.evict(keep=[2]) == ((0, b"a"), 0)  # c's block is busy: a goes
    assert tier.evict(keep=[2]) is None
    with pytest.raises(ValueError):
        TierIndex(0)


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


def _scheduler(num_gpu_blocks: int = 6, num_cpu_blocks: int = 8, **kwargs) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            block_size=BS,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            num_cpu_offload_blocks=num_cpu_blocks,
            max_model_len=24,
            **kwargs,
        )  # fmt: skip
    )


def _run_to_end(s: Scheduler, seq_id: int, prompt: list[int]) -> tuple[Request, list[StepPlan]]:
    """Runs one request (max_tokens 1) to its end and one plan more (the removal); its plans."""
    request = _request(seq_id, prompt)
    request.max_tokens = 1
    s.add_request(request)
    plans = []
    while s.get_request(request.seq_id) is not None:
        plans.append(s.schedule())
        s.process_output(plans[-1].step_id, plans[-1].sampling_seq_ids, [7] * len(plans[-1].sampling_seq_ids))
    plans.append(s.schedule())
    return request, plans


def test_the_scheduler_offloads_evictions_and_loads_hits_a_plan_before_the_prefill():
    """Cached free blocks are offloaded ahead of their eviction (`offload`, beside a step's
    forward), so the plan that reuses them copies nothing in its step. A tier hit is loaded by the
    plan that admits it (`load`, beside that step's forward), and its tokens are scheduled from the
    next plan on, on top of the loaded blocks."""
    s = _scheduler()
    _, first = _run_to_end(s, 1, list(range(100, 117)))
    assert sorted(gpu for gpu, _ in first[-1].offload) == [0, 1, 2, 3], "its 4 full blocks, once free"
    assert all(not plan.swap_out for plan in first)
    _, evicting = _run_to_end(s, 2, list(range(200, 221)))
    assert not evicting[0].swap_out and not evicting[0].offload, "its blocks were in the tier already"
    again = _request(3, list(range(100, 117)))
    again.max_tokens = 1
    s.add_request(again)
    loading = s.schedule()
    assert again.status is RequestStatus.LOADING and s.loading == (again,)
    assert loading.load and not loading.new_requests and loading.num_scheduled_tokens == 0
    assert not loading.is_empty, "a plan of loads alone is sent"
    kv = s.kv_cache_manager
    gpu_ids = kv.block_ids(again.seq_id)
    hit = again.num_cached_prompt_tokens  # (the tier's LRU let the oldest block go: 8 host blocks)
    assert hit >= 12 and again.num_computed_tokens == hit and s.num_running_requests == 1
    assert {gpu for _, gpu in loading.load} <= set(gpu_ids[: hit // BS]) and len(gpu_ids) == 5
    assert len(loading.load) * BS == again.num_cpu_cached_prompt_tokens > 0
    prefill = s.schedule()
    assert [r.seq_id for r in prefill.new_requests] == [again.seq_id] and not prefill.load
    (new,) = prefill.new_requests
    assert new.num_computed_tokens == hit and new.num_new_tokens == 17 - hit
    assert new.block_tables == [(0, gpu_ids)] and prefill.sampling_seq_ids == [again.seq_id]
    assert again.status is RequestStatus.RUNNING
    stats = s.stats
    assert stats.kv_loaded_blocks == len(loading.load)
    assert stats.cpu_prefix_cache_hit_tokens == again.num_cpu_cached_prompt_tokens
    assert stats.cpu_tier_capacity_blocks == 8 and 0 < stats.cpu_tier_blocks <= 8


def _evict_to_tier(s: Scheduler, prompt: list[int]) -> None:
    """Computes `prompt`, then fills the GPU pool with another request, so that `prompt`'s blocks
    are only in the CPU tier."""
    _run_to_end(s, 90, prompt)
    probe = _request(0, prompt)
    for filler in range(91, 99):
        if s.kv_cache_manager.get_computed_blocks(probe).num_cpu_blocks == len(prompt) // BS:
            return
        _run_to_end(s, filler, list(range(100 * filler, 100 * filler + 21)))
    raise AssertionError("the prompt's blocks never left the GPU pool")


def test_requests_behind_a_tier_hit_start_in_the_same_plan_and_a_twin_waits_for_the_load():
    """Admission is FCFS, and a load delays nobody behind it: the plan that loads A's prefix also
    starts B (a miss) at once; C, whose GPU hit is the blocks A's load writes, waits like A."""
    s = _scheduler(num_gpu_blocks=12, num_cpu_blocks=64, max_num_batched_tokens=32)
    prefix = list(range(100, 117))
    _evict_to_tier(s, prefix)
    a, b, c = _request(1, prefix), _request(2, list(range(300, 306))), _request(3, prefix + [5])
    for request in (a, b, c):
        s.add_request(request)
    first = s.schedule()
    assert [r.seq_id for r in first.new_requests] == [b.seq_id]
    assert len(first.load) == 4 and s.loading == (a, c)
    assert c.num_computed_tokens == 16 and c.num_cpu_cached_prompt_tokens == 0, "a GPU hit"
    s.process_output(first.step_id, first.sampling_seq_ids, [7] * len(first.sampling_seq_ids))
    second = s.schedule()
    assert [r.seq_id for r in second.new_requests] == [a.seq_id, c.seq_id] and not second.load
    assert [r.seq_id for r in second.running] == [b.seq_id]
    assert s.loading == ()


def test_a_plans_loads_stay_within_the_load_budget_and_the_next_plan_takes_the_rest():
    """With `max_num_loaded_blocks`, a plan admits tier hits in order while their loads fit; the
    head whose loads would pass it waits for the next plan (and, FCFS, those behind it), whose
    forward computes the first one's chunk beside the second one's loads. A miss before it is
    admitted as ever; the first tier hit of a plan goes whatever it loads."""
    s = _scheduler(num_gpu_blocks=16, num_cpu_blocks=64, max_num_batched_tokens=32, max_num_loaded_blocks=6)
    first, second = list(range(100, 117)), list(range(400, 417))
    _run_to_end(s, 80, first)
    _evict_to_tier(s, second)
    probe = _request(0, first)
    assert s.kv_cache_manager.get_computed_blocks(probe).num_cpu_blocks == 4, "both only in the tier"
    a, b, c, d = (
        _request(1, first),
        _request(2, list(range(300, 306))),
        _request(3, second),
        _request(4, [9] * 6),
    )
    for request in (a, b, c, d):
        s.add_request(request)
    plan = s.schedule()
    assert s.loading == (a,) and len(plan.load) == 4
    assert [r.seq_id for r in plan.new_requests] == [b.seq_id], "a miss behind a tier hit still starts"
    assert c.status is RequestStatus.WAITING and d.status is RequestStatus.WAITING, "4 + 4 loads > 6"
    s.process_output(plan.step_id, plan.sampling_seq_ids, [7] * len(plan.sampling_seq_ids))
    plan = s.schedule()
    assert [r.seq_id for r in plan.new_requests] == [a.seq_id, d.seq_id], "a's chunk beside c's loads"
    assert s.loading == (c,) and len(plan.load) == 4
    assert {gpu for _, gpu in plan.load} <= set(s.kv_cache_manager.block_ids(c.seq_id))


def test_a_tier_hit_larger_than_the_load_budget_goes_alone():
    s = _scheduler(num_gpu_blocks=12, num_cpu_blocks=64, max_num_loaded_blocks=1)
    prefix = list(range(100, 117))
    _evict_to_tier(s, prefix)
    a, b = _request(1, prefix), _request(2, prefix + [5])
    s.add_request(a)
    s.add_request(b)
    plan = s.schedule()
    assert s.loading == (a, b) and len(plan.load) == 4, "b's hit is the blocks a loads: no load of its own"


def test_the_load_budget_is_what_the_host_link_moves_while_the_weights_are_read():
    # The llama-8b shape on the H200 (benchmarks/results/2026-12-04-h200): 15.01 GB of weights at
    # 3.87 TB/s is 3.88 ms, in which a 55.3 GB/s host link moves 102 blocks of 2 MiB.
    assert load_budget(15_009_849_344, 3.87e12, 55.3e9, 2 << 20) == 102
    assert load_budget(1_000, 1e12, 1e9, 2 << 20) == 1, "at least one block"
    assert load_budget(15_009_849_344, 0.0, 55.3e9, 2 << 20) == 0, "no device bandwidth: off CUDA"
    assert load_budget(15_009_849_344, 3.87e12, 0.0, 2 << 20) == 0, "no host link measured: no tier"
    with pytest.raises(ValueError, match="max_num_loaded_blocks"):
        SchedulerConfig(block_size=BS, num_gpu_blocks=8, max_model_len=16, max_num_loaded_blocks=-1)


def test_a_request_cancelled_while_loading_frees_its_blocks_and_the_load_stays_cached():
    s = _scheduler(num_cpu_blocks=64)
    prefix = list(range(100, 117))
    _evict_to_tier(s, prefix)
    kv = s.kv_cache_manager
    request = _request(1, prefix)
    s.add_request(request)
    loading = s.schedule()
    assert request.status is RequestStatus.LOADING and kv.block_pool.num_blocks_in_use == 5
    s.abort_request(request.seq_id)
    assert request.status is RequestStatus.FINISHED and s.loading == () and not s.has_unfinished_requests()
    assert kv.block_pool.num_blocks_in_use == 0 and kv.num_blocks(request.seq_id) == 0
    after = s.schedule()
    assert after.removed_seq_ids == [], "the executor never held it"
    assert s.stats.num_running == 0
    # The loaded blocks stay in the GPU prefix cache (the executor's next step waits for the load).
    twin = _request(2, prefix)
    assert kv.get_computed_blocks(twin).num_tokens == 16
    assert kv.get_computed_blocks(twin).num_cpu_blocks == 0
    assert {gpu for _, gpu in loading.load} == {b.block_id for b in kv.get_computed_blocks(twin).blocks}


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


def round_trip(runner: ModelRunner, beside: bool) -> None:
    """A prompt's KV offloaded to host blocks and loaded into other GPU blocks, while another
    request computes in the same steps (on CUDA the copy stream runs beside its forward), is bit
    for bit what was computed; the neighbour's next step reads it in place."""
    assert (
        runner.num_cpu_offload_blocks > 0 and runner.kv_cache.num_cpu_blocks == runner.num_cpu_offload_blocks
    )
    runner.reset()
    prompt = list(range(5, 37))  # two full blocks of 16

    def new(seq_id: int, blocks: list[int]) -> executor_pb2.NewRequest:
        table = executor_pb2.BlockTable(block_ids=blocks)
        return executor_pb2.NewRequest(
            seq_id=seq_id, token_ids=prompt, num_new_tokens=32, block_tables=[table]
        )

    runner.execute(executor_pb2.StepPlan(new_requests=[new(1, [3, 4, 5])]))
    pool = runner.kv_cache.device_pool
    computed = pool[:, :, [3, 4]].clone()
    out = [executor_pb2.BlockMove(src=3, dst=0), executor_pb2.BlockMove(src=4, dst=1)]
    back = [executor_pb2.BlockMove(src=0, dst=9), executor_pb2.BlockMove(src=1, dst=11)]
    before = runner.stats.swap_out_blocks, runner.stats.swap_in_blocks
    neighbour = new(2, [6, 7, 8])
    runner.execute(
        executor_pb2.StepPlan(
            removed_seq_ids=[1], new_requests=[neighbour], **{"offload" if beside else "swap_out": out}
        )
    )
    pool[:, :, [3, 4]] = float("nan")  # the GPU blocks are reused
    decode = executor_pb2.RunningRequest(seq_id=2, num_new_tokens=1)
    runner.execute(executor_pb2.StepPlan(running=[decode], **{"load" if beside else "swap_in": back}))
    runner.execute(executor_pb2.StepPlan(running=[decode]))  # (the step after: it waits for the copies)
    loaded = pool[:, :, [9, 11]]
    assert torch.equal(loaded.view(torch.uint8), computed.view(torch.uint8))
    assert torch.equal(pool[:, :, [6, 7]].view(torch.uint8), computed.view(torch.uint8)), "same prompt"
    assert (runner.stats.swap_out_blocks, runner.stats.swap_in_blocks) == (before[0] + 2, before[1] + 2)


@pytest.mark.parametrize("beside", [False, True], ids=["in-step swaps", "copy stream"])
def test_a_block_loaded_from_the_tier_is_the_block_that_was_evicted(runner, beside: bool):
    """Through the executor's own plan path, whether the moves run in the step (swap_out /
    swap_in) or beside it (offload / load: the CPU tier's copy stream); CUDA: test_executor_cuda."""
    round_trip(runner, beside)


def test_an_executor_refuses_a_host_pool_the_machine_cannot_hold(tiny_model_dir):
    from pagedserve.executor.kv_cache import HostPoolError

    with pytest.raises(HostPoolError, match="--kv-offloading-size"):
        ModelRunner.create(
            ExecutorConfig(model=str(tiny_model_dir), device="cpu", num_gpu_blocks_override=16,
                           kv_offloading_size=1e9, max_model_len=128)
        )  # fmt: skip


def test_the_load_budget_override_is_read_from_the_environment(monkeypatch):
    from pagedserve.scheduler.kv_tier import _load_budget_override

    monkeypatch.delenv("PAGEDSERVE_MAX_NUM_LOADED_BLOCKS", raising=False)
    assert _load_budget_override() is None
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_LOADED_BLOCKS", "0")
    assert _load_budget_override() == 0
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_LOADED_BLOCKS", "-3")
    with pytest.raises(ValueError, match="PAGEDSERVE_MAX_NUM_LOADED_BLOCKS must be a non-negative integer"):
        _load_budget_override()
