"""The Scheduler: queues and policy. Each ``schedule()`` returns one StepPlan that maps one to one
onto ``pagedserve.v1.StepPlan``.

Token-centric, as in vLLM V1: there is no prefill or decode phase. Every request has
``num_computed_tokens`` and ``num_tokens``, and each step gives each request, up to the token
budget, the tokens it lacks. Prefill, chunked prefill, prefix caching, decoding and resumption after
preemption all follow from that one rule.

One plan is in flight ahead: the engine calls ``schedule()`` for step N+1 before the output of step
N arrives. A request whose scheduled tokens reach ``num_tokens`` samples a token in that step, so
``schedule()`` counts it as pending at once (``num_pending_outputs += 1``); the next ``schedule()``
can already give the request its decode token, which the executor feeds itself, and
``process_output`` later fills in the value.

Structured outputs: the mask of a constrained request's next token depends on the token before
it, which is still on the device while plan N+1 is made. With ``config.late_masks`` (the executor
takes them: AttachResponse.accepts_late_masks) the masks go *behind the plan*, as vLLM V1 does with
async scheduling: plan N+1 schedules the request like any other (the executor feeds the token
itself) and names it in ``late_masked_seq_ids``; once output N has advanced its matcher
(``process_output``), ``fill_late_masks`` makes the masks of plan N+1's late rows, which the replica
sends at once as a StepMasks. The executor runs plan N+1's forward meanwhile and samples it when the
masks arrive, so a constrained request advances every step, as an unconstrained one. A constrained
request with no output pending (its first token, one resumed) gets its mask in the plan, filled
when the plan is finished (``_finish_step``). A request that finishes with output N (its grammar
ended, a stop string, an abort) while plan N+1 holds it is left out of the late masks (the
executor samples that row without a mask): its token is discarded and its blocks were freed when
it finished, as for any request whose stop is found one plan late. Without ``late_masks`` a
constrained request is given tokens only when no output of it is pending (``_num_tokens_wanted``),
so it samples in every other plan while the pipeline is full. Unconstrained requests are untouched:
without a constrained request a plan carries no mask and nothing here costs anything.

Speculative decoding (``config.speculative``) uses the same rule: in a step where speculation is on
(at most ``disable_by_batch_size`` requests running), a request is given tokens only with no output
pending, since its proposals need its latest tokens and its slots depend on how many were accepted
(with n-gram proposals only a request that is copying waits so: one whose known tokens end in an
n-gram seen before; the others stay in every plan, without proposals, ``_waits``).
A request whose scheduled tokens reach its end then also gets up to k proposed tokens
(``RunningPlan.draft_token_ids``: n-gram proposals made here, scheduler.ngram; or, for the
draft_model method, only their count, the executor's draft proposes them), capped by max_tokens and
the step's budget, with KV slots for them (``num_computed_tokens`` counts them while the step is in
flight, ``num_draft_tokens`` says how many). Its output carries the accepted proposals plus one
token; ``process_output`` takes the rejected ones back out of ``num_computed_tokens`` and trims the
request's tables to the block of its last computed token, or, with a draft model, of the last slot
the next verification needs (``SpeculativeConfig.num_lookahead_slots``: a verification allocates
them with its own where they fit, so that the executor can launch the next one before its plan
comes). The prefix cache registers only blocks full of
known tokens (``min(num_computed, num_known)``), and proposals are never known tokens until they
are accepted, so no registered block ever holds a rejected token. A constrained request speculates
with n-gram proposals cut to what its grammar allows (``RequestGrammar.allowed_prefix``), and its
masks are one per verified position (``fill_bitmasks_along``), made with the plan: proposals are
inputs of the forward pass and cannot come late, so a constrained request that waits for proposals
(``_waits``) keeps the every-other-plan rule even with late masks; one that does not wait goes
without proposals and with a late mask. Without a speculative config nothing here costs anything.

Order within a step:
1. running requests, by (priority, arrival): decodes and ongoing prefill chunks; a request that
   needs a block when none is free pre-empts the lowest-priority, latest-arrived running request
   (possibly itself);
2. requests whose prefix an earlier plan loaded from the CPU tier (LOADING) start, with a chunk
   within the blocks they were admitted with;
3. if nothing was pre-empted: swapped-out and waiting requests start, in one (priority, arrival)
   order, with prefill chunks that fill the remaining budget; a head that does not fit may pre-empt
   running requests of strictly lower priority, if together they hold the blocks it lacks.

CPU tier loads (scheduler.kv_tier) overlap other requests' steps. A waiting request whose prefix hit
includes blocks the tier holds is admitted as now (its blocks allocated, the loads named in the
plan's ``load``), but it becomes LOADING instead of RUNNING: the plan schedules none of its tokens,
so the executor runs the copies on its copy stream beside this step's forward, and the request's
first chunk is scheduled from the next plan on, whose forward waits for the copies. A request whose
GPU hit includes a block this very plan loads (another request's) waits in the same way. A LOADING
request leaves the waiting queue and uses none of the plan's budget, so the requests queued behind
it are admitted in the same plan, as long as the plan's loads stay within
``config.max_num_loaded_blocks`` (what the host link moves during one forward: a plan's loads
beyond it would stall the next forward, every running request with it). The first tier hit of a
plan always goes; a head whose loads would pass the budget waits for the next plan, and those
behind it with it, so loads are pipelined: one plan's loads run beside the forward that computes
the chunks of the requests loaded by the plan before. Order stays FCFS within a priority,
priorities strict. Blocks hit in the disk tier below are fetched into the CPU tier while the plan's
step runs and loaded by the next plan, so their requests (and those sharing the blocks) start a plan
later (`KVCacheManager.is_loading`); their loads count against the budget of the admitting plan.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from pagedserve.scheduler.block_pool import BlockHash
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.kv_cache_manager import NO_HIT, BlockSpan, KVCacheManager, PrefixHit
from pagedserve.scheduler.ngram import NgramProposer
from pagedserve.scheduler.request import Request, RequestStatus, SamplingOptions, SeqId
from pagedserve.scheduler.structured import batch_matcher, fill_bitmasks, fill_bitmasks_along

log = structlog.get_logger()


@dataclass(slots=True)
class NewRequestPlan:
    """A request the executor does not hold: new, or resumed after preemption (pagedserve.v1.NewRequest)."""

    seq_id: SeqId
    token_ids: list[int]  # every known token: prompt, then outputs so far
    num_computed_tokens: int  # already in its blocks (prefix cache or swap-in)
    num_new_tokens: int
    block_tables: list[BlockSpan]  # its whole block table per KV-cache group
    sampling: SamplingOptions


@dataclass(slots=True)
class RunningPlan:
    """A request the executor holds: append blocks, compute tokens (pagedserve.v1.RunningRequest)."""

    seq_id: SeqId
    num_new_tokens: int  # proposed tokens included
    new_blocks: list[BlockSpan]  # per KV-cache group; empty when no group got a block
    num_draft_tokens: int = 0  # speculative decoding: the last num_draft_tokens are proposals
    draft_token_ids: list[int] = field(default_factory=list)  # n-gram: their ids (draft_model: none)


@dataclass(slots=True)
class StepPlan:
    """One step (pagedserve.v1.StepPlan). The executor applies swap_out, removed_seq_ids, swap_in,
    then computes new_requests and running in one forward pass, then samples.

    ``sampling_seq_ids`` lists, in plan order (new_requests, then running), the requests whose
    computed tokens reach their end in this step: the executor's StepOutput carries one token for
    each. It is not part of the wire message.

    ``masked_seq_ids`` / ``token_bitmask``: the constrained requests among them and their packed
    next-token masks, one int32 row each (structured outputs; empty without any); with
    ``config.shared_mask_rows``, ``mask_rows`` (when not empty) names each one's row, and the
    bitmask holds each distinct mask once (``share_rows``).
    ``late_masked_seq_ids``: the constrained requests among them whose masks follow the plan
    (``Scheduler.fill_late_masks``), their previous token being in flight.
    """

    step_id: int
    removed_seq_ids: list[SeqId] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    # The CPU tier's copies beside the forward (copy stream): no block of theirs is touched by this
    # step's tokens; the next step's forward waits for them.
    offload: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, tier block)
    load: list[tuple[int, int]] = field(default_factory=list)  # (tier block, gpu block)
    # The disk tier's moves, which the executor runs before all the others, spills first.
    spill: list[tuple[int, int]] = field(default_factory=list)  # (tier block, disk slot)
    fetch: list[tuple[int, int]] = field(default_factory=list)  # (disk slot, tier block)
    spill_ahead: list[tuple[int, int]] = field(default_factory=list)  # (tier block, disk slot)
    new_requests: list[NewRequestPlan] = field(default_factory=list)
    running: list[RunningPlan] = field(default_factory=list)
    sampling_seq_ids: list[SeqId] = field(default_factory=list)
    masked_seq_ids: list[SeqId] = field(default_factory=list)
    token_bitmask: np.ndarray | None = None
    mask_rows: list[int] = field(default_factory=list)
    late_masked_seq_ids: list[SeqId] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(p.num_new_tokens for p in self.new_requests) + sum(p.num_new_tokens for p in self.running)

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor to do (no tokens, no block moves, nothing to forget)."""
        return not (
            self.removed_seq_ids
            or self.swap_out
            or self.swap_in
            or self.offload
            or self.load
            or self.spill
            or self.fetch
            or self.spill_ahead
            or self.new_requests
            or self.running
        )


@dataclass(slots=True)
class LateMasks:
    """The masks behind plan ``step_id`` (pagedserve.v1.StepMasks): one int32 row per seq id, a
    subset of the plan's late_masked_seq_ids (the requests still constrained and live); or, when
    ``rows`` is not empty, each distinct row once and ``rows[i]`` the one of ``seq_ids[i]``."""

    step_id: int
    seq_ids: list[SeqId]
    token_bitmask: np.ndarray
    rows: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    """Gauges and counters. Slot utilization is the fraction of the slots of GPU blocks in use that
    hold (or will hold, once in-flight plans run) a token's KV."""

    num_waiting: int
    num_running: int
    num_swapped: int
    num_preemptions: int
    num_gpu_blocks: int
    gpu_blocks_in_use: int
    peak_gpu_blocks_in_use: int
    cached_free_blocks: int
    slot_utilization: float
    peak_slot_utilization: float  # at the end of the schedule() where blocks in use peaked
    prompt_tokens_computed: int  # tokens computed at prompt positions, recomputation included
    prefix_cache_hit_tokens: int  # tokens taken from the prefix cache, over all admissions
    prefix_cache_query_tokens: int  # known tokens of all admissions looked up in the cache
    cpu_prefix_cache_hit_tokens: int = 0  # of the hits, tokens loaded from the CPU tier
    kv_offloaded_blocks: int = 0  # blocks copied GPU -> CPU tier (on eviction)
    kv_loaded_blocks: int = 0  # blocks copied CPU tier -> GPU (on a hit)
    cpu_tier_blocks: int = 0  # gauge: blocks the CPU tier holds
    cpu_tier_capacity_blocks: int = 0  # gauge: the most it may hold
    kv_spilled_blocks: int = 0  # blocks written CPU tier -> disk tier (the CPU tier dropped them)
    kv_fetched_blocks: int = 0  # blocks read disk tier -> CPU tier (on a hit)
    disk_tier_blocks: int = 0  # gauge: blocks the disk tier holds
    disk_tier_capacity_blocks: int = 0  # gauge: the most it may hold
    spec_draft_tokens: int = 0  # speculative decoding: tokens proposed and verified
    spec_accepted_tokens: int = 0  # of them, accepted
    spec_steps: int = 0  # verifications (one per request per step with proposals)
    spec_accepted_per_pos: tuple[int, ...] = ()  # accepted proposals by position (0 = first)


@dataclass(slots=True)
class _Step:
    """Scratch state of one schedule() call."""

    plan: StepPlan
    budget: int
    unserved: int = 0  # running requests still to be served this step that want tokens
    running_plans: dict[SeqId, RunningPlan] = field(default_factory=dict)
    sampling: set[SeqId] = field(default_factory=set)
    admitted: set[SeqId] = field(default_factory=set)
    preempted: set[SeqId] = field(default_factory=set)
    shared: set[SeqId] = field(default_factory=set)  # registered blocks in this step: never un-scheduled


def _sort_key(request: Request) -> tuple[int, int]:
    return request.sort_key


class Scheduler:
    """Decides, step by step, which requests run, how many tokens each computes, and their blocks.

    Owns the three queues (waiting, running, swapped; each kept sorted by (priority, arrival)) and
    the policy; block bookkeeping is delegated to the KVCacheManager.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.block_size,
            config.num_gpu_blocks,
            config.num_cpu_blocks,
            config.enable_prefix_caching,
            config.sliding_windows,
            config.num_cpu_offload_blocks,
            config.num_disk_offload_blocks,
        )
        self._requests: dict[SeqId, Request] = {}  # every unfinished request
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._swapped: list[Request] = []
        self._loading: list[Request] = []  # admitted on a CPU tier hit, starting in the next plan
        self._removed: list[SeqId] = []  # finished while the executor held them: forget next step
        # What the router knows of requests not yet admitted (see add_request): their prompt blocks'
        # hash chains, counted, and the tokens each is expected to compute.
        self._queued_hashes: Counter[BlockHash] = Counter()
        self._queued_prefixes: dict[SeqId, tuple[Sequence[BlockHash], int]] = {}
        self._in_flight: dict[int, set[SeqId]] = {}  # step id -> requests that sample in it
        self._next_step_id = 0
        self._next_arrival = 0
        self._num_preemptions = 0
        self._peak_blocks_in_use = 0
        self._peak_slot_utilization = 0.0
        self._prompt_tokens_computed = 0
        self._prefix_hit_tokens = 0
        self._prefix_query_tokens = 0
        self._cpu_prefix_hit_tokens = 0
        self._batch_matcher = None  # xgrammar's, made for the first plan with constrained requests
        self._spec = spec = config.speculative
        self._spec_on = False  # speculation in the step being planned (disable_by_batch_size)
        self._ngram = None
        if spec is not None and spec.method == "ngram":
            assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
            self._ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self._spec_draft_tokens = 0
        self._spec_accepted_tokens = 0
        self._spec_steps = 0
        self._spec_accepted_per_pos = [0] * (self._spec.num_speculative_tokens if self._spec else 0)
        self._lookahead = spec.num_lookahead_slots if spec is not None else 0
        self.mask_seconds: list[float] = []  # per plan with masks: the time filling them took
        # CPU tier: how many of the blocks the pool hands out next are offloaded ahead of their
        # eviction, each plan: as many as one plan's tokens can take (each request's chunk may
        # start a block of its own); a bigger allocation (a long load) copies the rest in its step.
        self._offload_lookahead = -(-config.max_num_batched_tokens // config.block_size) + config.max_num_seqs

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request: Request, block_hashes: Sequence[BlockHash] = ()) -> None:
        """Queues a new request (WAITING, ordered by priority then arrival).

        ``block_hashes``, the hash chain of its prompt's full blocks (the router computes it), makes
        its prefix visible to the router before it is admitted (``num_prefix_hit_blocks``):
        requests placed together with a common prefix then go where the first one will compute it,
        and ``num_queued_tokens`` counts that prefix once.

        Raises:
            ValueError: duplicate seq_id, empty prompt, max_tokens < 1, or a sequence longer than
                max_model_len.
        """
        if request.seq_id in self._requests:
            raise ValueError(f"seq {request.seq_id} is already scheduled")
        if not request.prompt_token_ids:
            raise ValueError(f"seq {request.seq_id}: empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"seq {request.seq_id}: max_tokens must be >= 1, got {request.max_tokens}")
        if request.num_prompt_tokens + request.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"seq {request.seq_id}: prompt {request.num_prompt_tokens} + max_tokens {request.max_tokens}"
                f" exceeds max_model_len {self.config.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        request.arrival = self._next_arrival
        self._next_arrival += 1
        self._requests[request.seq_id] = request
        bisect.insort(self._waiting, request, key=_sort_key)
        if block_hashes:
            hit_tokens = self.num_prefix_hit_blocks(block_hashes) * self.config.block_size
            self._queued_prefixes[request.seq_id] = (block_hashes, request.num_tokens - hit_tokens)
            self._queued_hashes.update(block_hashes)

    def abort_request(self, seq_id: SeqId) -> None:
        """Finishes a request (abort or stop condition): frees its blocks (full computed ones stay
        in the prefix cache) and marks it FINISHED. If the executor holds its state, the id goes into
        the next plan's removed_seq_ids; a late output for it is ignored. Unknown ids are a no-op."""
        request = self._requests.pop(seq_id, None)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self._remove_running(request)
            self.kv_cache_manager.free(request)
            self._removed.append(request.seq_id)
        elif request.status is RequestStatus.SWAPPED:
            self._swapped.remove(request)
            self.kv_cache_manager.free_swapped(request)
        elif request.status is RequestStatus.LOADING:  # the executor does not hold it yet
            self._loading.remove(request)
            self.kv_cache_manager.free(request)
        else:
            self._waiting.remove(request)
            self._forget_queued_prefix(seq_id)
        self.kv_cache_manager.forget(seq_id)
        if self._ngram is not None:
            self._ngram.forget(seq_id)
        request.status = RequestStatus.FINISHED

    def get_request(self, seq_id: SeqId) -> Request | None:
        return self._requests.get(seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans the next step. The plan may be empty (nothing to do); step ids are consecutive
        over all calls."""
        step = _Step(
            StepPlan(self._next_step_id, removed_seq_ids=self._removed), self.config.max_num_batched_tokens
        )
        self._next_step_id += 1
        self._removed = []
        spec = self._spec
        self._spec_on = spec is not None and (
            spec.disable_by_batch_size is None or len(self._running) <= spec.disable_by_batch_size
        )
        self._schedule_running(step)
        self._start_loaded(step)
        # A step that had to pre-empt has no room to admit anyone (and must not re-admit a victim).
        if not step.preempted:
            self._start_queued(step)
        self.kv_cache_manager.offload_ahead(self._offload_lookahead)
        self.kv_cache_manager.spill_ahead()
        plan = self._finish_step(step)
        self.kv_cache_manager.end_step()
        return plan

    def _schedule_running(self, step: _Step) -> None:
        """Gives each running request, in (priority, arrival) order, the tokens it lacks.

        A chunk is capped so that every later running request that wants tokens can still get one:
        a long prefill never stalls the decodes of others.
        """
        candidates = [(request, self._num_tokens_wanted(request)) for request in self._running]
        step.unserved = sum(1 for _, wanted in candidates if wanted)
        for request, wanted in candidates:
            if not wanted or request.status is not RequestStatus.RUNNING:
                continue  # done generating, or pre-empted earlier in this step
            step.unserved -= 1
            if step.budget == 0:
                continue
            num_new = min(wanted, step.budget, max(1, step.budget - step.unserved))
            num_draft, drafts = 0, []
            if self._spec_on and num_new == wanted:
                num_draft, drafts = self._propose(request, num_new, step)
            total = num_new + num_draft
            new_blocks = None
            if num_draft and self._lookahead:  # the next verification's slots too, where they fit
                new_blocks = self._allocate_lookahead(request, request.num_computed_tokens + total)
            if new_blocks is None:
                new_blocks = self._allocate_or_preempt(request, request.num_computed_tokens + total, step)
            if new_blocks is None:
                continue  # it pre-empted itself
            running_plan = RunningPlan(request.seq_id, total, new_blocks, num_draft, drafts)
            step.plan.running.append(running_plan)
            step.running_plans[request.seq_id] = running_plan
            self._schedule_tokens(request, total, step, num_draft)

    def _propose(self, request: Request, num_new: int, step: _Step) -> tuple[int, list[int]]:
        """Speculative decoding: how many tokens to propose after the `num_new` tokens that reach
        the request's end, and their ids (n-gram; the draft_model method leaves them to the
        executor's draft), within max_tokens (the accepted ones and the bonus token must fit) and
        the step's budget (the requests still unserved keep one token each); (0, []): none."""
        spec = self._spec
        assert spec is not None
        if request.num_pending_outputs or (request.grammar is not None and self._ngram is None):
            return 0, []  # (a draft model's proposals would need masks of their own)
        room = min(
            spec.num_speculative_tokens,
            request.max_tokens - request.num_sampled_tokens - 1,
            step.budget - num_new - step.unserved,
        )
        if room < 1:
            return 0, []
        if self._ngram is None:  # draft_model, after one token: the draft has the KV of all before it
            return (room, []) if num_new == 1 else (0, [])
        drafts = self._ngram.propose(request, room)
        if request.grammar is not None:
            drafts = request.grammar.allowed_prefix(drafts)
        return len(drafts), drafts

    def _allocate_lookahead(self, request: Request, num_tokens: int) -> list[BlockSpan] | None:
        """Grows a draft-model verification's tables past its ``num_tokens`` to the next
        verification's slots too (`SpeculativeConfig.num_lookahead_slots`), if that leaves a block
        for each running request to grow by: a reservation never costs anyone a pre-emption.
        None: not reserved (nothing changed)."""
        ahead = min(num_tokens + self._lookahead, self.config.max_model_len)
        if self.kv_cache_manager.num_spare_blocks(request, ahead) < len(self._running):
            return None
        return self.kv_cache_manager.allocate_slots(request, ahead)

    def _allocate_or_preempt(self, request: Request, num_tokens: int, step: _Step) -> list[BlockSpan] | None:
        """Allocates blocks for a running request, pre-empting the lowest-priority, latest-arrived
        running request until they fit. Returns None if the request itself was the victim.

        The running list is in (priority, arrival) order and served front to back, so the victim
        (its tail) has not been served in this step yet, or is the request itself.
        """
        while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_tokens)) is None:
            victim = self._running[-1]
            if victim is not request and self._num_tokens_wanted(victim):
                step.unserved -= 1
            self._preempt(victim, step)
            if victim is request:
                return None
        return new_blocks

    def _start_queued(self, step: _Step) -> None:
        """Starts swapped-out and waiting requests, in one (priority, arrival) order, while budget
        and seq slots last: swapped ones swap their KV back in, waiting ones reuse cached prefix
        blocks.

        Strictly in order: a head that cannot start blocks the ones behind it, so a big request is
        not starved by a stream of small ones. It may pre-empt running requests of strictly lower
        priority, but only if together they hold enough blocks to make room for it.
        """
        while step.budget > 0 and len(self._running) + len(self._loading) < self.config.max_num_seqs:
            request = self._queued_head()
            if request is None or request.num_pending_outputs or request.seq_id in step.preempted:
                break  # a victim awaiting its last output, or pre-empted in this very step
            if request.status is RequestStatus.SWAPPED:
                num_blocks_short, keep = self._swap_in(request, step), NO_HIT
            else:
                keep = self.kv_cache_manager.get_computed_blocks(request)
                if self._exceeds_load_budget(keep):
                    break  # its loads go in the next plan, and (in order) so do those behind it
                num_blocks_short = self._admit(request, keep, step)
            if num_blocks_short and not self._preempt_lower_priority(request, num_blocks_short, keep, step):
                break

    def _exceeds_load_budget(self, hit: PrefixHit) -> bool:
        """Whether admitting on `hit` would take the plan's tier loads past
        `config.max_num_loaded_blocks` (scheduler.kv_tier.load_budget), the plan already loading
        some: the first tier hit of a plan always goes, so a long history is never starved."""
        budget, planned = self.config.max_num_loaded_blocks, self.kv_cache_manager.num_planned_loads
        if not (budget and planned):
            return False
        loads = hit.num_loads  # (a hit without loads of its own never waits for the budget)
        return loads > 0 and planned + loads > budget

    def _queued_head(self) -> Request | None:
        """The first of the swapped and waiting queues' heads in (priority, arrival) order."""
        heads = [queue[0] for queue in (self._swapped, self._waiting) if queue]
        return min(heads, key=_sort_key, default=None)

    def _swap_in(self, request: Request, step: _Step) -> int:
        """Swaps a swapped-out request back in; returns the blocks it lacks (0 once it runs)."""
        num_new = min(self._num_tokens_wanted(request), step.budget)
        num_tokens = request.num_computed_tokens + num_new
        moves = self.kv_cache_manager.swap_in(request, num_tokens)
        if moves is None:
            return self.kv_cache_manager.num_blocks_short(request, num_tokens)
        self._swapped.remove(request)
        step.plan.swap_in.extend(moves)
        self._start_running(request, num_new, step)
        return 0

    def _admit(self, request: Request, hit: PrefixHit, step: _Step) -> int:
        """Admits a waiting request on top of its cached prefix blocks; returns the blocks it lacks
        (0 once it runs)."""
        num_cached_tokens = hit.num_tokens
        num_new = min(request.num_tokens - num_cached_tokens, step.budget)
        num_tokens = num_cached_tokens + num_new
        if self.kv_cache_manager.allocate_slots(request, num_tokens, hit) is None:
            return self.kv_cache_manager.num_blocks_short(request, num_tokens, hit)
        self._waiting.remove(request)
        self._forget_queued_prefix(request.seq_id)
        if self.config.enable_prefix_caching:
            self._prefix_hit_tokens += num_cached_tokens
            self._prefix_query_tokens += request.num_tokens
            self._cpu_prefix_hit_tokens += hit.num_cpu_blocks * self.config.block_size
        if request.num_preemptions == 0:  # first admission
            request.num_cached_prompt_tokens = num_cached_tokens
            request.num_cpu_cached_prompt_tokens = hit.num_cpu_blocks * self.config.block_size
        request.num_computed_tokens = num_cached_tokens
        if self.kv_cache_manager.waits_for_loads(hit):
            request.status = RequestStatus.LOADING
            bisect.insort(self._loading, request, key=_sort_key)
        else:
            self._start_running(request, num_new, step)
        return 0

    def _start_loaded(self, step: _Step) -> None:
        """Starts the LOADING requests (admitted by an earlier plan, which loaded their prefix), in
        (priority, arrival) order, while budget lasts. Each chunk stays within the blocks the
        request was admitted with (at least one token's room), so starting needs no allocation and
        can neither fail nor pre-empt; blocks past a smaller chunk are given back (as if the chunk
        had been planned so from the start)."""
        kv, size = self.kv_cache_manager, self.config.block_size
        waiting = []  # blocks loaded by this very plan (fetched from the disk tier by the last one)
        while self._loading and step.budget > 0:
            request = self._loading.pop(0)
            if kv.is_loading(request.seq_id):
                waiting.append(request)
                continue
            room = len(kv.blocks(request.seq_id)) * size - request.num_computed_tokens
            wanted = request.num_tokens - request.num_computed_tokens
            num_new = min(wanted, step.budget, room)
            kv.trim(request, request.num_computed_tokens + num_new)
            self._start_running(request, num_new, step)
        self._loading[:0] = waiting

    def _preempt_lower_priority(
        self, request: Request, num_blocks_short: int, keep: PrefixHit, step: _Step
    ) -> bool:
        """Pre-empts the lowest-priority, latest-arrived running request if its priority is strictly
        lower than ``request``'s (a larger number) and it was not started in this step, provided
        that all such requests together hold the ``num_blocks_short`` blocks ``request`` lacks
        (less ``keep``, its prefix hits): a pre-emption that cannot make room only costs work.

        A request that registered blocks in this step is no victim either: others may already
        share blocks whose KV only its part of this plan writes."""
        victims = [
            victim
            for victim in self._running
            if victim.priority > request.priority
            and victim.seq_id not in step.admitted
            and victim.seq_id not in step.shared
        ]
        reclaimable = self.kv_cache_manager.num_reclaimable_blocks(
            [victim.seq_id for victim in victims], keep
        )
        if not victims or reclaimable < num_blocks_short:
            return False
        self._preempt(victims[-1], step)
        return True

    def _start_running(self, request: Request, num_new: int, step: _Step) -> None:
        """Moves an admitted or resumed request (its blocks allocated) into running and the plan."""
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        bisect.insort(self._running, request, key=_sort_key)
        step.admitted.add(request.seq_id)
        step.plan.new_requests.append(
            NewRequestPlan(
                seq_id=request.seq_id,
                token_ids=request.all_token_ids,
                num_computed_tokens=request.num_computed_tokens,
                num_new_tokens=num_new,
                block_tables=self.kv_cache_manager.block_tables(request.seq_id),
                sampling=request.sampling,
            )
        )
        self._schedule_tokens(request, num_new, step)

    def _schedule_tokens(self, request: Request, num_new: int, step: _Step, num_draft: int = 0) -> None:
        """Counts ``num_new`` tokens as computed and registers the blocks they fill in the prefix
        cache (requests admitted later in this step may share them); if that reaches the end, the
        step samples a token. The last ``num_draft`` of them are proposals (never registered: they
        are not known tokens)."""
        start = request.num_computed_tokens
        if start < request.num_prompt_tokens:  # (a decode step's token is past the prompt)
            self._prompt_tokens_computed += min(request.num_prompt_tokens - start, num_new)
        request.num_computed_tokens = start + num_new
        step.budget -= num_new
        if self.kv_cache_manager.cache_full_blocks(request):
            step.shared.add(request.seq_id)
        if request.num_computed_tokens - num_draft == request.num_tokens:
            request.num_pending_outputs += 1
            request.num_draft_tokens = num_draft
            step.sampling.add(request.seq_id)

    def _unschedule(self, request: Request, step: _Step) -> None:
        """Takes a running request back out of this step's plan (it is about to be pre-empted)."""
        running_plan = step.running_plans.pop(request.seq_id)
        step.plan.running.remove(running_plan)
        num_new = running_plan.num_new_tokens
        request.num_computed_tokens -= num_new
        step.budget += num_new
        start = request.num_computed_tokens
        if start < request.num_prompt_tokens:  # as counted in `_schedule_tokens`
            self._prompt_tokens_computed -= min(request.num_prompt_tokens - start, num_new)
        if request.seq_id in step.sampling:
            step.sampling.remove(request.seq_id)
            request.num_pending_outputs -= 1
            request.num_draft_tokens = 0

    def _preempt(self, request: Request, step: _Step) -> None:
        """Pre-empts a running request: swap its KV out (swap mode, if the CPU pool has room) or free
        its blocks and compute it again later (recompute). The executor forgets it either way."""
        self._remove_running(request)
        if request.seq_id in step.running_plans:
            self._unschedule(request, step)
        moves = self.kv_cache_manager.swap_out(request) if self.config.preemption_mode == "swap" else None
        if moves is not None:
            mode = "swap"
            step.plan.swap_out.extend(moves)
            request.status = RequestStatus.SWAPPED
            bisect.insort(self._swapped, request, key=_sort_key)
        else:
            mode = "recompute"
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            bisect.insort(self._waiting, request, key=_sort_key)
        request.num_preemptions += 1
        self._num_preemptions += 1
        step.plan.removed_seq_ids.append(request.seq_id)
        step.preempted.add(request.seq_id)
        log.info(
            "preempt", seq_id=request.seq_id, mode=mode, priority=request.priority, step_id=step.plan.step_id
        )

    def _finish_step(self, step: _Step) -> StepPlan:
        """Fills in the sampling list, records the step as in flight, and updates the statistics."""
        plan = step.plan
        offloads, loads = self.kv_cache_manager.take_tier_moves()
        plan.swap_out += offloads  # blocks this plan reuses: copied before its forward writes them
        plan.load = loads  # beside the forward: their requests are LOADING (see the module doc)
        plan.offload = self.kv_cache_manager.take_offloads_ahead()  # beside it: free blocks
        plan.spill, plan.fetch, plan.spill_ahead = self.kv_cache_manager.take_disk_moves()
        plan.sampling_seq_ids = [p.seq_id for p in plan.new_requests if p.seq_id in step.sampling]
        plan.sampling_seq_ids += [p.seq_id for p in plan.running if p.seq_id in step.sampling]
        if plan.sampling_seq_ids:
            self._in_flight[plan.step_id] = set(plan.sampling_seq_ids)
            self._fill_masks(plan)
        in_use = self.kv_cache_manager.block_pool.num_blocks_in_use
        if in_use > self._peak_blocks_in_use:
            self._peak_blocks_in_use = in_use
            self._peak_slot_utilization = self._slot_utilization()
        return plan

    def _fill_masks(self, plan: StepPlan) -> None:
        """The next-token masks of the constrained requests that sample in `plan` (none: no cost
        beyond one attribute read per sampling request). A constrained request with n-gram
        proposals (the grammar allows them all: `RequestGrammar.allowed_prefix`) gets one mask per
        position it is verified at: after its known tokens, then after each proposal."""
        requests = self._requests
        constrained = [r for seq_id in plan.sampling_seq_ids if (r := requests[seq_id]).grammar is not None]
        if any(r.num_pending_outputs > 1 for r in constrained):  # a token in flight: masks follow
            plan.late_masked_seq_ids = [r.seq_id for r in constrained if r.num_pending_outputs > 1]
            constrained = [r for r in constrained if r.num_pending_outputs == 1]
        if not constrained:
            return
        start = time.perf_counter()
        drafts = {p.seq_id: p.draft_token_ids for p in plan.running if p.draft_token_ids}
        grammars = [r.grammar for r in constrained]
        if any(r.seq_id in drafts for r in constrained):
            plan.masked_seq_ids = [
                r.seq_id for r in constrained for _ in range(len(drafts.get(r.seq_id, ())) + 1)
            ]
            plan.token_bitmask = fill_bitmasks_along(
                grammars, [drafts.get(r.seq_id, []) for r in constrained], grammars[0].vocab_size
            )
        else:
            plan.masked_seq_ids = [r.seq_id for r in constrained]
            plan.token_bitmask, plan.mask_rows = self._fill(grammars)
        self._record_mask_time(start)

    def fill_late_masks(self, plan: StepPlan) -> LateMasks | None:
        """Masks behind the plan: called once the output of the step before `plan` is processed
        (its tokens fed to the matchers), the masks of `plan`'s late rows (None: it has none).
        Requests that finished or were aborted meanwhile, or whose grammar ended, are left out:
        the executor samples their rows without a mask, and their tokens are discarded."""
        if not plan.late_masked_seq_ids:
            return None
        start = time.perf_counter()
        live = [
            r
            for seq_id in plan.late_masked_seq_ids
            if (r := self._requests.get(seq_id)) is not None
            and r.grammar is not None
            and not (r.grammar.failed or r.grammar.is_terminated)
        ]
        grammars = [r.grammar for r in live]
        if not grammars:
            return LateMasks(plan.step_id, [], np.zeros((0, 0), dtype=np.int32))
        masks = LateMasks(plan.step_id, [r.seq_id for r in live], *self._fill(grammars))
        self._record_mask_time(start)
        return masks

    def _fill(self, grammars: list) -> tuple[np.ndarray, list[int]]:
        """One mask row per grammar (xgrammar's batch matcher from 16 rows: its threads), and no
        row index; with ``config.shared_mask_rows``, each distinct row once and each grammar's
        row index (``share_rows``; none when no two are the same)."""
        if self._batch_matcher is None and len(grammars) >= 16:
            self._batch_matcher = batch_matcher()
        vocab_size = grammars[0].vocab_size
        return fill_bitmasks(grammars, vocab_size, self._batch_matcher, self.config.shared_mask_rows)

    def _record_mask_time(self, start: float) -> None:
        self.mask_seconds.append(time.perf_counter() - start)
        if len(self.mask_seconds) > 4096:
            del self.mask_seconds[:2048]

    # ---- outputs -------------------------------------------------------------------------------

    def process_output(
        self,
        step_id: int,
        seq_ids: list[int],
        token_ids: list[int],
        num_tokens: Sequence[int] = (),
    ) -> list[Request]:
        """Fills in the tokens sampled in step ``step_id``.

        Each listed live request gets its tokens appended (``num_pending_outputs -= 1``):
        ``num_tokens[i]`` of them for ``seq_ids[i]`` (one each when empty), its accepted proposals
        and one more; the rejected proposals' slots are taken back (``_settle_drafts``). A request
        whose outputs reach ``max_tokens`` is finished here (blocks freed, status FINISHED).

        Returns:
            The requests that got tokens, in output order: live ones, plus those this call finished
            by length (status FINISHED). Outputs of aborted requests are ignored.
        """
        if not num_tokens:  # one token each: the loop of every step without speculation
            return self._process_one_each(step_id, seq_ids, token_ids)
        counts = list(num_tokens)
        if len(counts) != len(seq_ids) or sum(counts) != len(token_ids):
            raise ValueError(
                f"step {step_id}: {len(seq_ids)} seq ids, {len(counts)} token counts summing to "
                f"{sum(counts)}, but {len(token_ids)} tokens"
            )
        expected = self._in_flight.pop(step_id, set())
        updated: list[Request] = []
        offset = 0
        for seq_id, count in zip(seq_ids, counts, strict=True):
            tokens = token_ids[offset : offset + count]
            offset += count
            request = self._requests.get(SeqId(seq_id))
            if request is None:
                continue  # finished or aborted while the step ran
            if seq_id not in expected or request.num_pending_outputs == 0 or count < 1:
                log.warning("unexpected_output", step_id=step_id, seq_id=seq_id)
                continue
            if count > request.num_draft_tokens + 1:
                log.error("more tokens than proposals", step_id=step_id, seq_id=seq_id, count=count)
                tokens = tokens[: request.num_draft_tokens + 1]
            self._take_output(request, tokens, step_id)
            updated.append(request)
        return updated

    def _process_one_each(self, step_id: int, seq_ids: list[int], token_ids: list[int]) -> list[Request]:
        """`process_output` of an output with one token per request (no accepted proposals)."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"step {step_id}: {len(seq_ids)} seq ids but {len(token_ids)} tokens")
        expected = self._in_flight.pop(step_id, set())
        updated: list[Request] = []
        for seq_id, token_id in zip(seq_ids, token_ids, strict=True):
            request = self._requests.get(SeqId(seq_id))
            if request is None:
                continue  # finished or aborted while the step ran
            if seq_id not in expected or request.num_pending_outputs == 0:
                log.warning("unexpected_output", step_id=step_id, seq_id=seq_id)
                continue
            self._take_output(request, (token_id,), step_id)  # (no counts: no proposal accepted)
            updated.append(request)
        return updated

    def _take_output(self, request: Request, tokens: Sequence[int], step_id: int) -> None:
        """One request's share of a step's output: its in-flight proposals settled (all but the
        last token accepted), the tokens appended up to max_tokens and fed to its grammar, and
        the request finished once it reaches max_tokens."""
        request.num_pending_outputs -= 1
        if request.num_draft_tokens:
            self._settle_drafts(request, len(tokens) - 1)
        for token_id in tokens[: request.max_tokens - len(request.output_token_ids)]:
            request.output_token_ids.append(token_id)
            if request.grammar is not None and not request.grammar.accept(token_id):
                log.error(
                    "token outside the grammar", seq_id=request.seq_id, token_id=token_id, step_id=step_id
                )
        if len(request.output_token_ids) >= request.max_tokens:
            self.abort_request(request.seq_id)

    def _settle_drafts(self, request: Request, num_accepted: int) -> None:
        """Speculative decoding: of the request's ``num_draft_tokens`` proposals in flight,
        ``num_accepted`` were accepted. The rejected ones' slots leave ``num_computed_tokens`` and
        its tables (GPU, or CPU if it was swapped out meanwhile) are trimmed to the block of its
        last computed token, or on the GPU of the next verification's last slot (lookahead); the
        executor trims its copy the same way."""
        num_draft, request.num_draft_tokens = request.num_draft_tokens, 0
        num_accepted = min(num_accepted, num_draft)
        self._spec_steps += 1
        self._spec_draft_tokens += num_draft
        self._spec_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self._spec_accepted_per_pos[position] += 1
        request.num_draft_tokens_total += num_draft
        request.num_accepted_tokens_total += num_accepted
        if request.status is RequestStatus.WAITING:
            return  # pre-empted by recompute while the step ran: nothing computed is kept
        request.num_computed_tokens -= num_draft - num_accepted
        # (Swapped out, its CPU tables keep what its next query sees: no lookahead there.)
        ahead = self._lookahead if request.status is RequestStatus.RUNNING else 0
        self.kv_cache_manager.trim(request, request.num_computed_tokens + ahead)

    # ---- helpers and stats ---------------------------------------------------------------------

    def _num_tokens_wanted(self, request: Request) -> int:
        """Tokens the request lacks; 0 once its last allowed token is sampled (the final token's
        KV is never needed), and 0 while a token of it is in flight for a request whose next step
        needs it in the plan: its proposals and slots, or its mask without late masks."""
        if request.num_sampled_tokens >= request.max_tokens:
            return 0
        if request.num_pending_outputs and (
            request.num_draft_tokens
            or (request.grammar is not None and not self.config.late_masks)
            or (self._spec_on and self._waits(request))
        ):
            return 0  # its next mask, or its proposals and slots, need the output in flight
        return request.num_tokens - request.num_computed_tokens

    def _waits(self, request: Request) -> bool:
        """Speculative decoding: whether a request with an output pending waits for it, to get
        proposals in the plan after (a draft model always proposes); with n-gram proposals only a
        request whose known tokens end in an n-gram seen before: one that is copying. The others
        stay in every plan without proposals, as without speculation; so does a constrained request
        with a draft model, which never proposes for it (`_propose`)."""
        if self._ngram is None:
            return request.grammar is None
        return self._ngram.matches(request)

    def _remove_running(self, request: Request) -> None:
        if self._running and self._running[-1] is request:
            self._running.pop()
        else:
            self._running.remove(request)

    def _slot_utilization(self) -> float:
        """Only a request's last block (per group) can be partly filled, and shared blocks are full,
        so the empty slots are the per-request tails."""
        manager = self.kv_cache_manager
        in_use = manager.block_pool.num_blocks_in_use
        if in_use == 0:
            return 0.0
        empty = sum(manager.num_empty_slots(r) for r in self._running)
        return 1.0 - empty / (in_use * self.config.block_size)

    @property
    def stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.block_pool
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_swapped=len(self._swapped),
            num_preemptions=self._num_preemptions,
            num_gpu_blocks=pool.num_blocks,
            gpu_blocks_in_use=pool.num_blocks_in_use,
            peak_gpu_blocks_in_use=self._peak_blocks_in_use,
            cached_free_blocks=pool.num_cached_free_blocks,
            slot_utilization=self._slot_utilization(),
            peak_slot_utilization=self._peak_slot_utilization,
            prompt_tokens_computed=self._prompt_tokens_computed,
            prefix_cache_hit_tokens=self._prefix_hit_tokens,
            prefix_cache_query_tokens=self._prefix_query_tokens,
            cpu_prefix_cache_hit_tokens=self._cpu_prefix_hit_tokens,
            kv_offloaded_blocks=self.kv_cache_manager.num_offloaded_blocks,
            kv_loaded_blocks=self.kv_cache_manager.num_loaded_blocks,
            cpu_tier_blocks=len(tier) if (tier := self.kv_cache_manager.tier) is not None else 0,
            cpu_tier_capacity_blocks=tier.capacity if tier is not None else 0,
            kv_spilled_blocks=self.kv_cache_manager.num_spilled_blocks,
            kv_fetched_blocks=self.kv_cache_manager.num_fetched_blocks,
            disk_tier_blocks=len(disk) if (disk := self.kv_cache_manager.disk_tier) is not None else 0,
            disk_tier_capacity_blocks=disk.capacity if disk is not None else 0,
            spec_draft_tokens=self._spec_draft_tokens,
            spec_accepted_tokens=self._spec_accepted_tokens,
            spec_steps=self._spec_steps,
            spec_accepted_per_pos=tuple(self._spec_accepted_per_pos),
        )

    @property
    def num_running_requests(self) -> int:
        """Running requests, and those about to run once their prefix is loaded (LOADING)."""
        return len(self._running) + len(self._loading)

    @property
    def num_queued_requests(self) -> int:
        """Requests waiting to start: new, pre-empted or swapped out."""
        return len(self._waiting) + len(self._swapped)

    @property
    def num_queued_tokens(self) -> int:
        """Tokens the queued (waiting and swapped-out) requests still have to compute: the work a
        new request would wait behind (the router's load). A prefix that several queued requests
        share counts once (the estimate made when each was queued)."""
        estimates = self._queued_prefixes
        return sum(
            estimates[r.seq_id][1] if r.seq_id in estimates else r.num_tokens - r.num_computed_tokens
            for r in self._waiting
        ) + sum(r.num_tokens - r.num_computed_tokens for r in self._swapped)

    def num_prefix_hit_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain `block_hashes` are in the prefix cache (either
        tier) or in the prompt of a queued request (computed before a request queued now would
        start): the hit such a request is expected to get here."""
        return self.prefix_hit_blocks(block_hashes)[0]

    def prefix_hit_blocks(self, block_hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """`num_prefix_hit_blocks`, and how many of those blocks would be loaded from the CPU tier
        rather than found on the GPU (the router weighs a load between a hit and a miss)."""
        hit = self.kv_cache_manager.lookup_prefix(block_hashes)
        num_cached = hit.num_tokens // self.config.block_size
        num_queued = 0
        for block_hash in block_hashes:
            if not self._queued_hashes[block_hash]:
                break
            num_queued += 1
        if num_queued > num_cached:
            return num_queued, 0  # a queued request computes them on the GPU first
        return num_cached, hit.num_cpu_blocks

    def _forget_queued_prefix(self, seq_id: SeqId) -> None:
        """Drops a request's prefix from the router's view once it is admitted (its blocks are then
        in the prefix cache) or aborted."""
        entry = self._queued_prefixes.pop(seq_id, None)
        if entry is None:
            return
        self._queued_hashes.subtract(entry[0])
        for block_hash in entry[0]:
            if self._queued_hashes[block_hash] <= 0:
                del self._queued_hashes[block_hash]

    # Read-only views for tests and the engine's metrics.
    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def swapped(self) -> tuple[Request, ...]:
        return tuple(self._swapped)

    @property
    def loading(self) -> tuple[Request, ...]:
        return tuple(self._loading)
