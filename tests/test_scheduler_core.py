"""Scheduler policy on tiny configs: exact plans, block ids, preemption, priorities, pending tokens."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.core import NewRequestPlan, RunningPlan, Scheduler, StepPlan
from pagedserve.scheduler.request import Request, RequestStatus, SamplingOptions, SeqId


def make_scheduler(**overrides) -> Scheduler:
    config = dict(block_size=2, num_gpu_blocks=4, max_model_len=8, max_num_batched_tokens=64)
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))


def add(s: Scheduler, seq_id: int, prompt: list[int], max_tokens: int = 4, priority: int = 0) -> Request:
    request = Request(SeqId(seq_id), list(prompt), max_tokens, SamplingOptions(), priority=priority)
    s.add_request(request)
    return request


def token_for(seq_id: int, step_id: int) -> int:
    return 1000 + 10 * seq_id + step_id


def deliver(s: Scheduler, plan: StepPlan) -> list[Request]:
    tokens = [token_for(seq_id, plan.step_id) for seq_id in plan.sampling_seq_ids]
    return s.process_output(plan.step_id, list(plan.sampling_seq_ids), tokens)


def step(s: Scheduler) -> StepPlan:
    """One step whose output arrives before the next schedule()."""
    plan = s.schedule()
    deliver(s, plan)
    return plan


def tokens_by_seq(plan: StepPlan) -> dict[int, int]:
    return {p.seq_id: p.num_new_tokens for p in (*plan.new_requests, *plan.running)}


# ---- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(block_size=0), "block_size"),
        (dict(num_gpu_blocks=-1), "num_gpu_blocks"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
        (dict(preemption_mode="drop"), "preemption_mode"),
        (dict(num_gpu_blocks=3), "max_model_len"),
    ],
)
def test_config_validation(overrides: dict, message: str) -> None:
    config = dict(block_size=2, num_gpu_blocks=4, max_model_len=8)
    config.update(overrides)
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**config)


def test_add_request_validation() -> None:
    s = make_scheduler()
    with pytest.raises(ValueError, match="empty prompt"):
        add(s, 1, [])
    with pytest.raises(ValueError, match="max_tokens"):
        add(s, 1, [1], max_tokens=0)
    with pytest.raises(ValueError, match="max_model_len"):
        add(s, 1, [1, 2, 3], max_tokens=6)
    add(s, 1, [1])
    with pytest.raises(ValueError, match="already"):
        add(s, 1, [1])


# ---- one request, one plan in flight ahead ---------------------------------------------------------


def test_prefill_then_decode_one_step_ahead_and_max_tokens() -> None:
    s = make_scheduler(block_size=4, num_gpu_blocks=4, max_model_len=16)
    r = add(s, 1, [1, 2, 3, 4, 5, 6], max_tokens=3)
    p0 = s.schedule()
    assert p0.step_id == 0
    assert p0.running == []
    assert p0.removed_seq_ids == []
    assert p0.new_requests == [NewRequestPlan(1, [1, 2, 3, 4, 5, 6], 0, 6, [(0, [0, 1])], SamplingOptions())]
    assert p0.sampling_seq_ids == [1]
    assert p0.num_scheduled_tokens == 6
    assert r.num_pending_outputs == 1
    assert r.num_tokens == 7
    assert r.num_computed_tokens == 6
    # Step 1 is planned before step 0's output arrives: the decode token is the pending one.
    p1 = s.schedule()
    assert p1.running == [RunningPlan(1, 1, [])]
    assert p1.sampling_seq_ids == [1]
    assert r.num_pending_outputs == 2
    assert r.num_computed_tokens == 7
    assert s.process_output(0, [1], [50]) == [r]
    assert r.output_token_ids == [50]
    assert r.num_pending_outputs == 1
    p2 = s.schedule()  # position 7 still fits in block 1
    assert p2.running == [RunningPlan(1, 1, [])]
    assert r.num_sampled_tokens == 3 == r.max_tokens
    # Its last token is sampled: the final token's KV is never computed, nothing more to do.
    p3 = s.schedule()
    assert p3.is_empty
    assert p3.num_scheduled_tokens == 0
    assert s.process_output(1, [1], [51]) == [r]
    assert r.status is RequestStatus.RUNNING
    assert s.has_unfinished_requests()
    # The max_tokens-th output finishes it here; it is still returned (it got a token).
    assert s.process_output(2, [1], [52]) == [r]
    assert r.output_token_ids == [50, 51, 52]
    assert r.status is RequestStatus.FINISHED
    assert not s.has_unfinished_requests()
    assert s.get_request(SeqId(1)) is None
    assert s.schedule().removed_seq_ids == [1]
    assert s.kv_cache_manager.block_pool.num_blocks_in_use == 0
    assert s.stats.prompt_tokens_computed == 6


def test_max_tokens_one_samples_once() -> None:
    s = make_scheduler()
    r = add(s, 1, [1, 2, 3], max_tokens=1)
    p0 = s.schedule()
    assert p0.sampling_seq_ids == [1]
    assert s.schedule().is_empty  # no decode: it already sampled its only token
    s.process_output(p0.step_id, [1], [9])
    assert r.status is RequestStatus.FINISHED
    assert r.output_token_ids == [9]


def test_step_ids_are_consecutive_and_empty_plan() -> None:
    s = make_scheduler()
    assert s.schedule().is_empty
    add(s, 1, [1])
    assert s.schedule().step_id == 1


# ---- prefix caching ------------------------------------------------------------------------------


def test_prefix_hit_reuses_blocks_of_a_running_request() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=10, max_model_len=12)
    a = add(s, 1, [1, 2, 3, 4, 5], max_tokens=4)
    b = add(s, 2, [1, 2, 3, 4, 5], max_tokens=4)  # same step as a: it shares what a's part writes
    p0 = step(s)
    assert [p.block_tables for p in p0.new_requests] == [[(0, [0, 1, 2])], [(0, [0, 1, 3])]]
    assert [p.num_computed_tokens for p in p0.new_requests] == [0, 4]
    assert a.num_cached_prompt_tokens == 0
    assert b.num_cached_prompt_tokens == 4
    c = add(s, 3, [1, 2, 3, 4, 9, 9])
    p1 = step(s)
    (new_c,) = p1.new_requests
    assert new_c == NewRequestPlan(3, [1, 2, 3, 4, 9, 9], 4, 2, [(0, [0, 1, 4])], SamplingOptions())
    assert c.num_cached_prompt_tokens == 4
    blocks = s.kv_cache_manager.block_pool.blocks
    assert [blocks[i].ref_count for i in range(5)] == [3, 3, 1, 1, 1]
    assert s.stats.prefix_cache_hit_tokens == 8
    assert s.stats.prefix_cache_query_tokens == 16
    assert s.stats.prompt_tokens_computed == 5 + 1 + 2


def test_a_request_that_registered_blocks_in_the_step_is_no_victim_in_it() -> None:
    """Blocks are shared from the step that schedules their tokens: a request whose chunk just
    registered some cannot be un-scheduled (pre-empted) in that step, or a later admission could
    hit blocks whose KV nobody writes."""
    s = make_scheduler(block_size=2, num_gpu_blocks=4, max_model_len=8, max_num_batched_tokens=4)
    low = add(s, 1, [1, 2, 3, 4, 5, 6, 7], max_tokens=1, priority=5)
    step(s)  # tokens 0-3: blocks 0 and 1 registered
    high = add(s, 2, [8, 8, 8], max_tokens=1, priority=0)
    plan = s.schedule()  # low's tokens 4-6 fill block 2 (registered) and take the last free block
    assert tokens_by_seq(plan) == {1: 3}
    assert plan.removed_seq_ids == []
    assert low.status is RequestStatus.RUNNING
    assert high.status is RequestStatus.WAITING  # not admitted by pre-empting low in this step
    deliver(s, plan)
    for _ in range(10):
        if not s.has_unfinished_requests():
            break
        step(s)
    assert not s.has_unfinished_requests()
    assert len(low.output_token_ids) == len(high.output_token_ids) == 1


def test_queued_prefixes_are_visible_to_the_router_and_counted_once() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=20, max_model_len=16, max_num_batched_tokens=4)
    manager = s.kv_cache_manager
    prefix = [1, 2, 3, 4, 5, 6]
    first = Request(SeqId(1), prefix + [7], 2, SamplingOptions())
    s.add_request(first, manager.prompt_block_hashes(first.all_token_ids))
    other = manager.prompt_block_hashes(prefix + [8, 8, 8])
    assert manager.num_cached_blocks(other) == 0
    assert s.num_prefix_hit_blocks(other) == 3  # queued, not computed yet
    assert s.num_prefix_hit_blocks(manager.prompt_block_hashes([1, 2, 9, 9, 9])) == 1
    second = Request(SeqId(2), prefix + [8, 8, 8], 2, SamplingOptions())
    s.add_request(second, other)
    assert s.num_queued_tokens == 7 + (9 - 6)  # the shared prefix once
    s.abort_request(SeqId(2))
    assert s.num_queued_tokens == 7
    step(s)  # a budget of 4: the first request's first chunk; its 2 full blocks are now cached
    assert s.num_queued_tokens == 0
    assert s.num_prefix_hit_blocks(other) == 2
    step(s)
    assert s.num_prefix_hit_blocks(other) == 3
    assert not s._queued_hashes


def test_finished_blocks_stay_cached_and_whole_prompt_hit_recomputes_last_block() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=6, max_model_len=12)
    add(s, 1, [1, 2, 3, 4], max_tokens=1)
    step(s)  # finishes by length on its output
    assert not s.has_unfinished_requests()
    pool = s.kv_cache_manager.block_pool
    assert pool.num_blocks_in_use == 0
    assert pool.num_cached_free_blocks == 2
    r = add(s, 2, [1, 2, 3, 4], max_tokens=2)
    p = s.schedule()
    assert p.removed_seq_ids == [1]
    # The whole prompt is cached, but its last token must be computed: block 1 is not reused.
    (new,) = p.new_requests
    assert new.num_computed_tokens == 2
    assert new.num_new_tokens == 2
    assert new.block_tables[0][1][0] == 0
    assert new.block_tables[0][1][1] != 1
    assert r.num_cached_prompt_tokens == 2


def test_lru_eviction_of_cached_free_blocks() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=4, max_model_len=8)
    add(s, 1, [1, 2], max_tokens=1)
    step(s)
    add(s, 2, [3, 4], max_tokens=1)
    step(s)
    pool = s.kv_cache_manager.block_pool
    # 1's block 0 was freed before 2's block: it is the least recently used.
    assert [b.block_id for b in pool.free_queue()] == [2, 3, 0, 1]
    assert pool.num_cached_free_blocks == 2
    add(s, 3, [5, 6, 7, 8, 9], max_tokens=1)  # 3 blocks: the 2 uncached ones, then evicts LRU block 0
    p = s.schedule()
    assert p.new_requests[0].block_tables == [(0, [2, 3, 0])]
    assert [b.block_id for b in pool.free_queue()] == [1]
    assert pool.num_cached_free_blocks == 1
    deliver(s, p)
    add(s, 5, [3, 4, 7], max_tokens=1)
    add(s, 4, [1, 2, 7], max_tokens=1)
    p = s.schedule()
    assert [(r.seq_id, r.num_computed_tokens) for r in p.new_requests] == [(5, 2), (4, 0)]


def test_prefix_caching_off() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=10, max_model_len=12, enable_prefix_caching=False)
    add(s, 1, [1, 2, 3, 4, 5])
    step(s)
    c = add(s, 2, [1, 2, 3, 4, 5])
    p = step(s)
    assert p.new_requests[0].num_computed_tokens == 0
    assert c.num_cached_prompt_tokens == 0
    assert s.kv_cache_manager.block_pool.num_cached_blocks == 0
    assert s.stats.prefix_cache_query_tokens == 0


# ---- budget and chunked prefill ------------------------------------------------------------------


@pytest.mark.parametrize("long_priority", [0, -1])
def test_chunked_prefill_keeps_decodes_going(long_priority: int) -> None:
    s = make_scheduler(block_size=4, num_gpu_blocks=32, max_model_len=64, max_num_batched_tokens=8)
    for seq_id in (1, 2, 3):
        add(s, seq_id, [seq_id, seq_id], max_tokens=20)
    assert tokens_by_seq(step(s)) == {1: 2, 2: 2, 3: 2}
    long = add(s, 9, list(range(100, 121)), max_tokens=2, priority=long_priority)
    chunks = []
    for _ in range(5):
        plan = step(s)
        counts = tokens_by_seq(plan)
        assert counts[1] == counts[2] == counts[3] == 1  # the decodes never stall
        assert plan.num_scheduled_tokens <= 8
        chunks.append(counts[9])
    assert chunks == [5, 5, 5, 5, 1]
    assert long.num_computed_tokens == 21
    assert long.num_pending_outputs == 0
    assert len(long.output_token_ids) == 1


def test_budget_smaller_than_running_requests() -> None:
    s = make_scheduler(block_size=4, num_gpu_blocks=8, max_model_len=16, max_num_batched_tokens=2)
    for seq_id in (1, 2, 3):
        add(s, seq_id, [7], max_tokens=5)
    assert tokens_by_seq(step(s)) == {1: 1, 2: 1}
    assert tokens_by_seq(step(s)) == {1: 1, 2: 1}  # running first, in arrival order
    assert s.waiting[0].seq_id == 3


def test_max_num_seqs_caps_admission() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=16, max_model_len=8, max_num_seqs=2)
    for seq_id in (1, 2, 3):
        add(s, seq_id, [seq_id], max_tokens=2)
    assert tokens_by_seq(step(s)) == {1: 1, 2: 1}
    assert tokens_by_seq(step(s)) == {1: 1, 2: 1}  # 1 and 2 finish on this output
    plan = step(s)
    assert plan.removed_seq_ids == [1, 2]
    assert tokens_by_seq(plan) == {3: 1}


# ---- priorities ----------------------------------------------------------------------------------


def test_admission_by_priority_then_arrival() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=16, max_model_len=8, max_num_seqs=1)
    add(s, 1, [1], max_tokens=1, priority=5)
    add(s, 2, [2], max_tokens=1, priority=0)
    add(s, 3, [3], max_tokens=1, priority=5)
    add(s, 4, [4], max_tokens=1, priority=1)
    order = []
    while s.has_unfinished_requests():
        plan = step(s)
        order += [p.seq_id for p in plan.new_requests]
    assert order == [2, 4, 1, 3]


def test_higher_priority_arrival_preempts_lower_priority_running() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=4, max_model_len=8)
    low = add(s, 1, [1, 2, 3, 4, 5, 6], max_tokens=2, priority=5)
    assert step(s).new_requests[0].block_tables == [(0, [0, 1, 2])]
    high = add(s, 2, [7, 8, 9], max_tokens=2, priority=0)
    with capture_logs() as logs:
        p = step(s)
    # low's decode (which took block 3) is taken back out of the plan, low is pre-empted.
    assert p.removed_seq_ids == [1]
    assert p.running == []
    assert low.status is RequestStatus.WAITING
    assert low.num_preemptions == 1
    assert low.num_computed_tokens == 0
    assert low.num_pending_outputs == 0
    # low's freed blocks: 3 (empty) to the head, its cached chain 2, 1, 0 to the tail.
    assert p.new_requests == [NewRequestPlan(2, [7, 8, 9], 0, 3, [(0, [3, 2])], SamplingOptions())]
    assert [(e["event"], e["seq_id"], e["mode"]) for e in logs] == [("preempt", 1, "recompute")]
    assert s.stats.num_preemptions == 1
    # low cannot come back while high holds the blocks (and high never yields to it).
    plan = step(s)
    assert tokens_by_seq(plan) == {2: 1}
    assert high.status is RequestStatus.FINISHED
    plan = step(s)
    assert plan.removed_seq_ids == [2]
    (resumed,) = plan.new_requests
    assert resumed.seq_id == 1
    assert resumed.token_ids == [1, 2, 3, 4, 5, 6, token_for(1, 0)]
    assert resumed.num_computed_tokens == 4  # blocks 0 and 1 came back from the prefix cache
    assert low.num_cached_prompt_tokens == 0  # set at first admission only


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_preemption_only_when_it_makes_room(mode: str) -> None:
    # high outranks low but not mid; pre-empting low alone (2 blocks) cannot fit high (3 blocks).
    s = make_scheduler(
        block_size=4, num_gpu_blocks=4, max_model_len=16, preemption_mode=mode, num_cpu_blocks=8
    )
    mid = add(s, 1, [1] * 4, max_tokens=5, priority=0)
    low = add(s, 2, [2] * 4, max_tokens=9, priority=5)
    step(s)
    step(s)  # position 4: each takes its second block; the pool is full
    high = add(s, 3, [3] * 9, max_tokens=2, priority=0)
    while mid.status is not RequestStatus.FINISHED:
        plan = step(s)
        assert plan.removed_seq_ids == []
        assert plan.swap_out == []
        assert high.status is RequestStatus.WAITING
    # mid's two blocks are free now: pre-empting low makes room, and high goes first.
    plan = step(s)
    assert plan.removed_seq_ids == [1, 2]
    assert [p.seq_id for p in plan.new_requests] == [3]
    while high.status is not RequestStatus.FINISHED:
        assert 2 not in tokens_by_seq(step(s))
    while s.has_unfinished_requests():
        step(s)
    assert low.num_preemptions == 1
    assert len(low.output_token_ids) == 9


def test_equal_priority_arrival_does_not_preempt() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=4, max_model_len=8)
    add(s, 1, [1, 2, 3, 4, 5, 6], max_tokens=2)
    step(s)
    add(s, 2, [7, 8, 9], max_tokens=2)
    plan = step(s)
    assert plan.removed_seq_ids == []
    assert tokens_by_seq(plan) == {1: 1}


# ---- preemption ----------------------------------------------------------------------------------


def _two_growing_requests(**overrides) -> tuple[Scheduler, Request, Request]:
    s = make_scheduler(block_size=2, num_gpu_blocks=4, max_model_len=8, **overrides)
    a = add(s, 1, [1, 2, 3], max_tokens=5)
    b = add(s, 2, [4, 5, 6], max_tokens=5)
    p0 = step(s)
    assert [p.block_tables for p in p0.new_requests] == [[(0, [0, 1])], [(0, [2, 3])]]
    assert tokens_by_seq(step(s)) == {1: 1, 2: 1}  # position 3 fits in each one's block 1
    return s, a, b


def test_recompute_preemption_of_the_latest_arrival() -> None:
    s, a, b = _two_growing_requests()
    p2 = step(s)  # a needs a third block: b (latest) is pre-empted, its blocks freed
    assert p2.removed_seq_ids == [2]
    assert p2.new_requests == []
    # b's blocks 2, 3 were full and known: cached, freed tail first, so 3 is evicted first.
    assert p2.running == [RunningPlan(1, 1, [(2, [3])])]
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.output_token_ids == [token_for(2, 0), token_for(2, 1)]
    # b would need 3 blocks (block 2 back from the cache + 2 new): it waits for a to finish.
    while a.status is not RequestStatus.FINISHED:
        plan = step(s)
        assert 2 not in tokens_by_seq(plan)
    assert len(a.output_token_ids) == 5
    plan = step(s)
    assert plan.removed_seq_ids == [1]
    (resumed,) = plan.new_requests
    # All known tokens are computed again (a evicted block 2 meanwhile).
    assert resumed.token_ids == [4, 5, 6, token_for(2, 0), token_for(2, 1)]
    assert (resumed.num_computed_tokens, resumed.num_new_tokens) == (0, 5)
    assert plan.sampling_seq_ids == [2]
    while s.has_unfinished_requests():
        step(s)
    assert len(b.output_token_ids) == 5
    assert s.stats.num_preemptions == 1
    # Prompt positions computed: a 3, b 3 twice.
    assert s.stats.prompt_tokens_computed == 9


def test_swap_preemption_and_resume() -> None:
    s, a, b = _two_growing_requests(preemption_mode="swap", num_cpu_blocks=4)
    with capture_logs() as logs:
        p2 = step(s)
    assert p2.removed_seq_ids == [2]
    assert p2.swap_out == [(2, 0), (3, 1)]
    assert p2.running == [RunningPlan(1, 1, [(2, [3])])]
    assert [(e["seq_id"], e["mode"]) for e in logs] == [(2, "swap")]
    assert b.status is RequestStatus.SWAPPED
    assert b.num_computed_tokens == 4
    assert s.kv_cache_manager.cpu_block_ids(b.seq_id) == [0, 1]
    while a.status is not RequestStatus.FINISHED:
        plan = step(s)
        assert plan.swap_in == []
        assert 2 not in tokens_by_seq(plan)
    plan = step(s)
    assert plan.removed_seq_ids == [1]
    # a's free queue: its partial last block (2) at the head, then its cached chain 3, 1, 0.
    assert plan.swap_in == [(0, 2), (1, 3)]
    assert plan.new_requests == [
        NewRequestPlan(
            2, [4, 5, 6, token_for(2, 0), token_for(2, 1)], 4, 1, [(0, [2, 3, 1])], SamplingOptions()
        )
    ]
    assert b.status is RequestStatus.RUNNING
    assert s.kv_cache_manager.num_free_cpu_blocks == 4
    while s.has_unfinished_requests():
        step(s)
    assert len(b.output_token_ids) == 5


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full() -> None:
    s, a, b = _two_growing_requests(preemption_mode="swap", num_cpu_blocks=1)
    with capture_logs() as logs:
        p2 = step(s)
    assert p2.swap_out == []
    assert p2.removed_seq_ids == [2]
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert [e["mode"] for e in logs] == ["recompute"]


def test_requester_preempts_itself_when_it_is_the_latest() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=4, max_model_len=8)
    a = add(s, 1, [1, 2, 3, 4, 5], max_tokens=3)
    b = add(s, 2, [6], max_tokens=3)
    step(s)  # a: blocks 0-2, b: block 3
    plan = step(s)  # a's position 5 fits; b's position 1 fits
    assert tokens_by_seq(plan) == {1: 1, 2: 1}
    plan = step(s)  # a needs a 4th block: b is the victim; then a continues
    assert plan.removed_seq_ids == [2]
    assert tokens_by_seq(plan) == {1: 1}
    assert a.num_preemptions == 0
    assert b.num_preemptions == 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_request_waits_for_its_pending_output(mode: str) -> None:
    s = make_scheduler(
        block_size=2, num_gpu_blocks=4, max_model_len=8, preemption_mode=mode, num_cpu_blocks=4
    )
    a = add(s, 1, [1, 2, 3], max_tokens=5)
    b = add(s, 2, [4, 5, 6], max_tokens=5)
    p0 = s.schedule()
    p1 = s.schedule()  # step 0's output not in yet: both decode their pending token
    assert tokens_by_seq(p1) == {1: 1, 2: 1}
    deliver(s, p0)
    p2 = s.schedule()  # step 1's output still in flight: a needs a block, b is pre-empted
    assert p2.removed_seq_ids == [2]
    assert p2.running == [RunningPlan(1, 1, [(2, [3])])]
    assert b.num_pending_outputs == 1
    s.abort_request(a.seq_id)
    p3 = s.schedule()  # every block is free, but b's sampled token has not arrived
    assert p3.removed_seq_ids == [1]
    assert p3.new_requests == []
    assert p3.swap_in == []
    deliver(s, p1)
    assert b.num_pending_outputs == 0
    assert b.output_token_ids == [token_for(2, 0), token_for(2, 1)]
    p4 = s.schedule()
    tokens = [4, 5, 6, token_for(2, 0), token_for(2, 1)]
    if mode == "recompute":
        assert b.num_preemptions == 1
        assert p4.swap_in == []
        # Block 2 ([4, 5]) is still cached; block 3 ([6, t0]) was evicted when a took it.
        assert p4.new_requests == [NewRequestPlan(2, tokens, 2, 3, [(0, [2, 3, 1])], SamplingOptions())]
    else:
        # Its KV (4 tokens) comes back from the CPU; only the late token is computed.
        assert p4.swap_in == [(0, 3), (1, 2)]
        assert p4.new_requests == [NewRequestPlan(2, tokens, 4, 1, [(0, [3, 2, 1])], SamplingOptions())]


def test_swapped_and_waiting_requests_start_in_one_priority_order() -> None:
    s = make_scheduler(
        block_size=2, num_gpu_blocks=6, max_model_len=8, preemption_mode="swap", num_cpu_blocks=5
    )
    add(s, 1, [1, 2, 3], max_tokens=5, priority=1)
    x = add(s, 2, [4, 5, 6], max_tokens=5, priority=1)
    swapped = add(s, 3, [7, 8, 9], max_tokens=5, priority=1)
    step(s)
    step(s)
    p2 = step(s)  # seq 1 needs a third block: the latest arrival is swapped out
    assert p2.swap_out == [(4, 0), (5, 1)]
    assert swapped.status is RequestStatus.SWAPPED
    s.abort_request(x.seq_id)  # 3 blocks free: room for high (2) or for swapped (3), not both
    high = add(s, 4, [1, 1, 1], max_tokens=2, priority=0)
    p3 = step(s)
    assert [p.seq_id for p in p3.new_requests] == [4]
    assert p3.swap_in == []
    while high.status is not RequestStatus.FINISHED:
        assert step(s).swap_in == []
    while swapped.status is RequestStatus.SWAPPED:
        plan = step(s)
    assert [src for src, _ in plan.swap_in] == [0, 1]
    while s.has_unfinished_requests():
        step(s)
    assert len(swapped.output_token_ids) == 5
    assert swapped.num_preemptions == 1


def test_a_step_that_preempts_admits_nobody() -> None:
    s, a, b = _two_growing_requests()
    c = add(s, 3, [7], max_tokens=1, priority=-1)  # one block would do, and one is free after b goes
    p2 = step(s)
    assert p2.removed_seq_ids == [2]
    assert p2.new_requests == []
    assert s.kv_cache_manager.block_pool.num_free_blocks == 1
    p3 = step(s)
    assert [p.seq_id for p in p3.new_requests] == [3]
    assert c.status is RequestStatus.FINISHED


# ---- abort ---------------------------------------------------------------------------------------


def test_abort_frees_everything_and_late_outputs_are_ignored() -> None:
    s = make_scheduler(
        block_size=2, num_gpu_blocks=8, max_model_len=8, preemption_mode="swap", num_cpu_blocks=8
    )
    running = add(s, 1, [1, 2, 3])
    add(s, 2, [4, 5, 6])
    p0 = s.schedule()
    waiting = add(s, 3, [7])
    s.abort_request(SeqId(1))
    assert running.status is RequestStatus.FINISHED
    # The output of the in-flight step for the aborted request is ignored.
    returned = s.process_output(p0.step_id, [1, 2], [11, 12])
    assert [r.seq_id for r in returned] == [2]
    assert running.output_token_ids == []
    s.abort_request(SeqId(1))  # idempotent
    s.abort_request(SeqId(99))  # unknown: no-op
    s.abort_request(waiting.seq_id)
    p1 = s.schedule()
    assert p1.removed_seq_ids == [1]
    assert p1.new_requests == []
    s.abort_request(SeqId(2))
    assert s.schedule().removed_seq_ids == [2]
    assert not s.has_unfinished_requests()
    pool = s.kv_cache_manager.block_pool
    assert pool.num_blocks_in_use == 0
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert s.stats.num_running == s.stats.num_waiting == s.stats.num_swapped == 0


def test_abort_a_swapped_request_releases_its_cpu_blocks() -> None:
    s, a, b = _two_growing_requests(preemption_mode="swap", num_cpu_blocks=4)
    step(s)
    assert b.status is RequestStatus.SWAPPED
    assert s.kv_cache_manager.num_free_cpu_blocks == 2
    s.abort_request(b.seq_id)
    assert s.kv_cache_manager.num_free_cpu_blocks == 4
    assert b.status is RequestStatus.FINISHED
    assert 2 not in s.schedule().removed_seq_ids  # the executor already forgot it when swapped


# ---- progress and stats --------------------------------------------------------------------------


def test_a_request_as_long_as_the_pool_always_finishes() -> None:
    s = make_scheduler(block_size=2, num_gpu_blocks=4, max_model_len=8, max_num_batched_tokens=3)
    others = [add(s, i, [i], max_tokens=3) for i in (1, 2)]
    big = add(s, 3, [9, 9, 9, 9, 9], max_tokens=3)  # 8 tokens = the whole pool
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        step(s)
    assert not s.has_unfinished_requests()
    assert len(big.output_token_ids) == 3
    assert all(len(o.output_token_ids) == 3 for o in others)


def test_stats_peak_and_slot_utilization() -> None:
    s = make_scheduler(block_size=4, num_gpu_blocks=8, max_model_len=16)
    add(s, 1, [1, 2, 3, 4, 5], max_tokens=2)  # 2 blocks, 5 of 8 slots filled
    add(s, 2, [9, 2, 3, 4, 6, 7], max_tokens=2)  # no common prefix; 2 blocks, 6 of 8
    step(s)
    stats = s.stats
    assert stats.gpu_blocks_in_use == 4
    assert stats.peak_gpu_blocks_in_use == 4
    assert stats.slot_utilization == pytest.approx(11 / 16)
    assert stats.peak_slot_utilization == pytest.approx(11 / 16)
    assert stats.num_running == 2
    assert stats.num_gpu_blocks == 8
    step(s)  # one decode each; they finish on this output
    stats = s.stats
    assert stats.gpu_blocks_in_use == 0
    assert stats.peak_gpu_blocks_in_use == 4
    assert stats.cached_free_blocks == 2  # each prompt's one full block
    assert stats.slot_utilization == 0.0
