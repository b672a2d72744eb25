"""The engine: the table of active requests, their placement on executors, and their streams.

One scheduler drives many executors (data parallelism). Each attached executor is an
`ExecutorReplica` (scheduler/replica.py) with its own scheduling core and Step loop; the engine owns
what spans them: the request table (each request's prompt, the tokens streamed so far and its stop
state, in its `Completion`), the `Router` that places each new request on one executor
(scheduler/router.py), and the set of executors, found by address or DNS name
(scheduler/discovery.py) and re-resolved every `--executor-refresh-interval` seconds.

Failover: when an executor is lost (stream ended, keepalive timeout, lease fenced) or vanishes from
DNS, each request it held is re-placed as a new request from its prompt + the tokens already
accepted (recompute): the executor's sampler keys randomness by (seed, position) and the stop state
lives here, so the client's stream continues with no duplicated and no missing token; tokens the
lost executor sampled but never reported are simply computed again.

Requests that cannot be placed (no executor attached) wait here, in arrival order, until one
attaches; they end only when the client cancels or its deadline passes. `submit` refuses a request
with EngineUnavailable only before any executor ever attached: until then the model's limits
(vocabulary, max_model_len) are unknown and the request cannot be validated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from pagedserve.common.structured_outputs import StructuredOutputs
from pagedserve.protos import executor_pb2
from pagedserve.protos.executor_pb2 import BlockTable
from pagedserve.scheduler.completion import Completion, Delta, StopConditions
from pagedserve.scheduler.core import SchedulerStats, StepPlan
from pagedserve.scheduler.discovery import parse_executor_target, resolve_all
from pagedserve.scheduler.replica import (
    COUNTERS,
    ExecutorInfo,
    ExecutorReplica,
    ExecutorStatusView,
    add_counter,
)
from pagedserve.scheduler.request import Request, RequestStatus, SamplingOptions, SeqId
from pagedserve.scheduler.router import Router
from pagedserve.scheduler.service_config import ServiceConfig
from pagedserve.scheduler.structured import GrammarCompilerPool, RequestGrammar
from pagedserve.scheduler.transport import ExecutorTransport, GrpcTransport

__all__ = [
    "ActiveRequest",
    "Engine",
    "EngineFull",
    "EngineUnavailable",
    "ExecutorInfo",
    "ExecutorStatusView",
]

log = structlog.get_logger()


class EngineUnavailable(Exception):
    """The request cannot be served: no executor ever attached, or the scheduler is stopping."""


class EngineFull(Exception):
    """The engine already holds max_queue_len requests."""


@dataclass(eq=False)
class ActiveRequest:
    """A request between submission and its last delta; the client reads `deltas`.

    `request` is the scheduling core's view of it on its current executor (`replica`; None while
    it waits for one): a re-placed request gets a new `Request`, the completion stays.
    """

    request_id: str
    request: Request
    completion: Completion
    deltas: asyncio.Queue[Delta | Exception] = field(default_factory=asyncio.Queue)
    replica: ExecutorReplica | None = None

    @property
    def done(self) -> bool:
        return self.completion.finish_reason is not None


def plan_to_proto(plan: StepPlan, active: dict[SeqId, ActiveRequest]) -> executor_pb2.StepPlan:
    """The core's plan dataclasses map one to one onto the protocol's messages; the stop
    conditions the executor enforces while sampling (min_tokens) come from each request's
    completion."""

    def new_request(r) -> executor_pb2.NewRequest:
        s = r.sampling
        stop = active[r.seq_id].completion.stop
        request = active[r.seq_id].request
        return executor_pb2.NewRequest(
            seq_id=r.seq_id,
            token_ids=r.token_ids,
            num_computed_tokens=r.num_computed_tokens,
            num_new_tokens=r.num_new_tokens,
            block_tables=[BlockTable(first_index=first, block_ids=ids) for first, ids in r.block_tables],
            num_prompt_tokens=request.num_prompt_tokens,
            sampling=executor_pb2.Sampling(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                has_seed=s.seed is not None,
                seed=s.seed or 0,
                return_logprobs=s.return_logprobs,
                min_tokens=stop.min_tokens,
                stop_token_ids=sorted(stop.stop_token_ids) if stop.min_tokens else [],
            ),
        )

    message = executor_pb2.StepPlan(
        step_id=plan.step_id,
        removed_seq_ids=plan.removed_seq_ids,
        swap_out=[executor_pb2.BlockMove(src=s, dst=d) for s, d in plan.swap_out],
        swap_in=[executor_pb2.BlockMove(src=s, dst=d) for s, d in plan.swap_in],
        offload=[executor_pb2.BlockMove(src=s, dst=d) for s, d in plan.offload],
        load=[executor_pb2.BlockMove(src=s, dst=d) for s, d in plan.load],
        spill=[executor_pb2.BlockMove(src=s, dst=d) for s, d in plan.spill],
        fetch=[executor_pb2.BlockMove(src=s, dst=d) for s, d in plan.fetch],
        spill_ahead=[executor_pb2.BlockMove(src=s, dst=d) for s, d in plan.spill_ahead],
        new_requests=[new_request(r) for r in plan.new_requests],
    )
    if plan.masked_seq_ids:  # structured outputs: one packed row per constrained sampling request
        message.masked_seq_ids.extend(plan.masked_seq_ids)
        message.token_bitmask = plan.token_bitmask.astype("<i4", copy=False).tobytes()
        message.mask_rows.extend(plan.mask_rows)  # shared rows: each request's (none: one each)
    if plan.late_masked_seq_ids:  # their masks follow, once the step before is in (StepMasks)
        message.late_masked_seq_ids.extend(plan.late_masked_seq_ids)
    # One per running request every step: add() in place, and no empty block list to convert,
    # build them at a third of the cost of constructing each message.
    add_running = message.running.add
    for r in plan.running:
        if r.new_blocks:
            new_blocks = [BlockTable(first_index=first, block_ids=ids) for first, ids in r.new_blocks]
            running = add_running(seq_id=r.seq_id, num_new_tokens=r.num_new_tokens, new_blocks=new_blocks)
        else:
            running = add_running(seq_id=r.seq_id, num_new_tokens=r.num_new_tokens)
        if r.num_draft_tokens:  # speculative decoding
            running.num_draft_tokens = r.num_draft_tokens
            running.draft_token_ids.extend(r.draft_token_ids)
    return message


_ADMITTED = (RequestStatus.LOADING, RequestStatus.RUNNING, RequestStatus.SWAPPED)


def resumed_request(old: Request) -> Request:
    """A fresh core's copy of `old` (whose executor was lost): the same prompt, the outputs accepted
    so far as known tokens to recompute, and the prefix-cache figure of its first admission."""
    admitted = old.num_preemptions > 0 or old.status in _ADMITTED
    return Request(
        seq_id=old.seq_id,
        prompt_token_ids=old.prompt_token_ids,
        max_tokens=old.max_tokens,
        sampling=old.sampling,
        priority=old.priority,
        output_token_ids=list(old.output_token_ids),
        num_cached_prompt_tokens=old.num_cached_prompt_tokens,
        num_cpu_cached_prompt_tokens=old.num_cpu_cached_prompt_tokens,
        grammar=old.grammar,  # it has accepted exactly the outputs carried over
        # Counted as a preemption once admitted, so that its usage keeps the first admission's hit.
        num_preemptions=old.num_preemptions + int(admitted),
    )


TransportFactory = Callable[[str], ExecutorTransport]


class Engine:
    """Owns the request table, the router and the executors (one `ExecutorReplica` each).

    The interface the service, the benchmarks and the operators' tools rely on:

    * `run()`: finds and attaches the executors and serves until cancelled;
    * `submit(...)` / `abort(active)`: a request's life; `wait_until_attached()`;
    * `is_serving`: at least one executor is attached;
    * `model_info()`: an attached executor's ExecutorInfo (else the last one known; None before
      any executor attached);
    * `core_stats()`: SchedulerStats summed over executors; its counters never decrease;
    * `executor_statuses()`: one ExecutorStatusView per known executor;
    * `release_executors()`: gives every lease up (a draining scheduler);
    * `steps`, `tokens_generated`, `num_active_requests`, `num_steps_in_flight`.
    """

    def __init__(
        self, config: ServiceConfig, tokenizer: Any, transport_factory: TransportFactory | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._transport_factory: TransportFactory = transport_factory or GrpcTransport
        self._targets = [parse_executor_target(text) for text in config.executors]
        self._resolved: dict[str, list[str]] = {}
        self._replicas: dict[str, ExecutorReplica] = {}
        self._dropped = dict.fromkeys(COUNTERS, 0)  # counters of executors no longer known
        self._router = Router(config.routing_policy)
        self._active: dict[SeqId, ActiveRequest] = {}
        self._unplaced: dict[SeqId, ActiveRequest] = {}  # waiting for an executor, in arrival order
        self._next_seq_id = 1
        self._serving = asyncio.Event()
        self._last_info: ExecutorInfo | None = None
        self._released = False
        self._grammars: GrammarCompilerPool | None = None
        self.scheduler_id = f"scheduler@{socket.gethostname()}:{config.port}"
        self.steps = 0
        self.tokens_generated = 0

    # ---- the public view ----------------------------------------------------------------------

    @property
    def is_serving(self) -> bool:
        """At least one executor is attached."""
        return any(r.attached for r in self._replicas.values())

    def model_info(self) -> ExecutorInfo | None:
        """What an attached executor reported (all attached ones agree on the model); while none is
        attached, the last one known (requests wait for an executor of that model); None before
        the first attach."""
        for replica in self._replicas.values():
            if replica.attached and replica.info is not None:
                return replica.info
        return self._last_info

    def core_stats(self) -> SchedulerStats:
        """The scheduling cores' stats summed over the attached executors (gauges; requests waiting
        for an executor count as waiting); the counters also keep what lost and dropped executors'
        cores counted, so they never decrease. Peaks are summed; utilizations are weighted by blocks
        in use (peak_slot_utilization: the highest)."""
        cores = [s for r in self._replicas.values() if (s := r.core_stats()) is not None]
        in_use = sum(s.gpu_blocks_in_use for s in cores)
        counters = dict(self._dropped)
        for replica in self._replicas.values():
            for name, value in replica.counters().items():
                counters[name] = add_counter(counters[name], value)
        return SchedulerStats(
            num_waiting=sum(s.num_waiting for s in cores) + len(self._unplaced),
            num_running=sum(s.num_running for s in cores),
            num_swapped=sum(s.num_swapped for s in cores),
            num_gpu_blocks=sum(s.num_gpu_blocks for s in cores),
            gpu_blocks_in_use=in_use,
            peak_gpu_blocks_in_use=sum(s.peak_gpu_blocks_in_use for s in cores),
            cached_free_blocks=sum(s.cached_free_blocks for s in cores),
            slot_utilization=(
                sum(s.slot_utilization * s.gpu_blocks_in_use for s in cores) / in_use if in_use else 0.0
            ),
            peak_slot_utilization=max((s.peak_slot_utilization for s in cores), default=0.0),
            cpu_tier_blocks=sum(s.cpu_tier_blocks for s in cores),
            cpu_tier_capacity_blocks=sum(s.cpu_tier_capacity_blocks for s in cores),
            disk_tier_blocks=sum(s.disk_tier_blocks for s in cores),
            disk_tier_capacity_blocks=sum(s.disk_tier_capacity_blocks for s in cores),
            **counters,
        )

    def executor_statuses(self) -> list[ExecutorStatusView]:
        """Every executor this scheduler knows of (attached or not), in discovery order."""
        return [replica.status() for replica in self._replicas.values()]

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    @property
    def num_steps_in_flight(self) -> int:
        """Plans sent to executors whose outputs have not come back. A step planned one ahead can
        still run after its requests finished: `steps` settles once this is 0."""
        return sum(len(replica.plans_in_flight) for replica in self._replicas.values())

    async def wait_until_attached(self) -> ExecutorInfo:
        """Returns once an executor is attached and requests can be submitted."""
        while True:
            await self._serving.wait()
            info = self.model_info()
            if info is not None and self.is_serving:
                return info
            self._serving.clear()

    # ---- requests -----------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        stop: StopConditions,
        priority: int = 0,
        grammar: RequestGrammar | None = None,
    ) -> ActiveRequest:
        """Queues a validated request on an executor (or, with none attached, here until one
        attaches); its deltas arrive on the returned ActiveRequest. `grammar`: its matcher, for a
        constrained request (`compile_grammar`)."""
        if self._last_info is None:
            raise EngineUnavailable("no executor has attached yet")
        if self._released:
            raise EngineUnavailable("the scheduler released its executors (draining)")
        if len(self._active) >= self.config.max_queue_len:
            raise EngineFull(f"{len(self._active)} requests are queued (--max-queue-len)")
        seq_id = SeqId(self._next_seq_id)
        self._next_seq_id += 1
        request = Request(
            seq_id=seq_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=stop.max_tokens,
            sampling=sampling,
            priority=priority,
            grammar=grammar,
        )
        active = ActiveRequest(
            request_id,
            request,
            Completion(self.tokenizer, prompt_token_ids, stop, self.config.stream_interval),
        )
        self._active[seq_id] = active
        self._place(active)
        return active

    def grammar_compiler(self) -> GrammarCompilerPool:
        """The compiler for the model the executors serve (made on first use; again if another
        model's executors replaced them: a grammar's masks are as wide as the vocabulary)."""
        info = self.model_info()
        if info is None:
            raise EngineUnavailable("no executor has attached yet")
        pool = self._grammars
        if pool is None or pool.vocab_size != info.vocab_size or pool.stop_token_ids != info.eos_token_ids:
            if pool is not None:
                pool.close()
            pool = self._grammars = GrammarCompilerPool(self.tokenizer, info.vocab_size, info.eos_token_ids)
        return pool

    async def compile_grammar(self, spec: StructuredOutputs) -> RequestGrammar:
        """A matcher for a constraint, compiled on the compiler's threads (once per distinct
        constraint): only the caller waits. Raises InvalidRequest if it does not compile."""
        return await self.grammar_compiler().grammar(spec)

    def abort(self, active: ActiveRequest) -> None:
        """Drops a request whose client went away; its blocks return to the pool."""
        seq_id = active.request.seq_id
        if self._active.pop(seq_id, None) is not None:
            if not active.done:
                active.completion.abort()
            self._unplaced.pop(seq_id, None)
            if active.replica is not None:
                active.replica.finish_request(seq_id)
                active.replica = None
            log.debug("aborted", request_id=active.request_id, seq_id=seq_id)

    def _attached_replicas(self) -> list[ExecutorReplica]:
        return [r for r in self._replicas.values() if r.attached]

    def _place(self, active: ActiveRequest) -> None:
        """Routes a request to an attached executor, or keeps it here until one attaches."""
        replicas = self._attached_replicas()
        if not replicas:
            self._unplaced[active.request.seq_id] = active
            return
        request = active.request
        hashes = []
        if len(replicas) > 1 and self._router.policy == "prefix" and self.config.enable_prefix_caching:
            manager = replicas[0].scheduler.kv_cache_manager  # type: ignore[union-attr]
            hashes = manager.prompt_block_hashes(request.all_token_ids)
        index = self._router.choose(request.num_tokens, [r.load(hashes) for r in replicas])
        replica = replicas[index]
        try:
            replica.add_request(request, hashes)
        except ValueError as exc:  # limits changed with the executors (another model): cannot serve
            self._active.pop(request.seq_id, None)
            active.deltas.put_nowait(EngineUnavailable(f"the executors cannot serve it any more: {exc}"))
            return
        active.replica = replica

    def _place_unplaced(self) -> None:
        waiting, self._unplaced = self._unplaced, {}
        for active in waiting.values():
            self._place(active)

    # ---- ReplicaHost: what the executors' loops call -----------------------------------------

    def has_slot(self, replica: ExecutorReplica) -> bool:
        limit = self.config.max_executors
        if limit is None:
            return True
        return sum(1 for r in self._replicas.values() if r.attached and r is not replica) < limit

    def admit_executor(self, replica: ExecutorReplica, info: ExecutorInfo) -> str | None:
        spec = self.config.speculative_config
        if spec is not None and spec.method == "draft_model" and info.draft_model != spec.model:
            have = f"draft model {info.draft_model!r}" if info.draft_model else "no draft model"
            return (
                f"--speculative-config's draft_model method needs the executor to load the draft "
                f"{spec.model!r}; it has {have} (give the executor the same --speculative-config)"
            )
        if (
            spec is not None
            and spec.method == "draft_model"
            and info.num_speculative_tokens != spec.num_speculative_tokens
        ):
            return (
                f"--speculative-config's num_speculative_tokens is {spec.num_speculative_tokens}; the "
                f"executor's draft proposes {info.num_speculative_tokens} (give the executor the same "
                "--speculative-config)"
            )
        for other in self._attached_replicas():
            if other is not replica and other.info is not None:
                reason = other.info.mismatch(info)
                if reason is not None:
                    return reason
        return None

    def on_attached(self, replica: ExecutorReplica) -> None:
        self._last_info = replica.info
        self._serving.set()
        self._place_unplaced()

    def on_lost(self, replica: ExecutorReplica) -> None:
        """Re-places every request the lost executor held (see the module docstring)."""
        self._requeue(replica)
        if not self.is_serving:
            self._serving.clear()

    def _requeue(self, replica: ExecutorReplica) -> None:
        seq_ids, replica.seq_ids = sorted(replica.seq_ids), set()  # in arrival order
        moved = 0
        for seq_id in seq_ids:
            active = self._active.get(seq_id)
            if active is None or active.replica is not replica:
                continue
            active.replica = None
            active.request = resumed_request(active.request)
            self._place(active)
            moved += 1
        if moved:
            log.info("requests re-placed", executor=replica.address, requests=moved)

    def plan_to_proto(self, plan: StepPlan) -> executor_pb2.StepPlan:
        return plan_to_proto(plan, self._active)

    def on_output(
        self, replica: ExecutorReplica, plan: StepPlan, output: executor_pb2.StepOutput
    ) -> Callable[[], None]:
        """Settles a step's tokens in the replica's core and returns their delivery (detokenizing,
        stop strings, the clients' streams: `_deliver`), which the replica runs once the executor
        has its next plan when none is in flight (`ExecutorReplica._step_loop`)."""
        core = replica.scheduler
        assert core is not None
        self.steps += 1
        seq_ids, token_ids = list(output.seq_ids), list(output.token_ids)
        counts = list(output.num_tokens)
        core.process_output(output.step_id, seq_ids, token_ids, counts)
        return functools.partial(self._deliver, replica, seq_ids, token_ids, counts, output.logprobs)

    def _deliver(
        self,
        replica: ExecutorReplica,
        seq_ids: list[SeqId],
        token_ids: list[int],
        counts: list[int],
        logprobs: Sequence[float],
    ) -> None:
        """Streams a settled step's tokens to their requests; a stop string found here finishes
        the request in the core (`finish_request`), one plan late at most."""
        if counts:  # speculative decoding: one seq id per token; a stop ends the run where it is
            seq_ids = [seq_id for seq_id, count in zip(seq_ids, counts, strict=True) for _ in range(count)]
        get_active = self._active.get
        # Speculative decoding: a request's run of tokens goes out as one message (its deltas merged).
        runs: dict[int, tuple[ActiveRequest, Delta]] | None = {} if counts else None
        for i, (seq_id, token_id) in enumerate(zip(seq_ids, token_ids, strict=True)):
            active = get_active(seq_id)
            if active is None or active.replica is not replica:
                continue  # aborted
            completion = active.completion
            if completion.finish_reason is not None:
                continue  # the one discarded token after a late stop, or the rest of an accepted run
            self.tokens_generated += 1
            request = active.request
            logprob = logprobs[i] if request.sampling.return_logprobs else None
            grammar = request.grammar
            if grammar is not None and grammar.failed:
                delta = completion.abort()  # a token the mask should have excluded (logged)
            else:
                ended = grammar is not None and grammar.is_terminated
                delta = completion.add_token(token_id, logprob, ended)
            if delta is None:
                continue  # held back (--stream-interval)
            if runs is not None:
                if seq_id in runs:
                    delta = runs[seq_id][1].merged(delta)
                runs[seq_id] = (active, delta)
                if delta.finish_reason is None:
                    continue
                del runs[seq_id]
            active.deltas.put_nowait(delta)
            if delta.finish_reason is not None:
                del self._active[seq_id]
                replica.finish_request(seq_id)
                active.replica = None
        for active, delta in (runs or {}).values():
            active.deltas.put_nowait(delta)

    # ---- executors ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Finds the executors and keeps them attached until cancelled; every refresh interval it
        re-resolves dns:/// names (attaching new addresses, dropping vanished ones)."""
        try:
            while True:
                await self._refresh()
                tasks = [r._task for r in self._replicas.values() if r._task is not None]
                interval = self.config.executor_refresh_interval
                if tasks:
                    done, _ = await asyncio.wait(tasks, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:  # a replica loop only ends on a bug: fail loudly
                        task.result()
                        raise RuntimeError(f"{task.get_name()} stopped")
                else:
                    await asyncio.sleep(interval)
        except asyncio.CancelledError:
            await self._stop_all("the scheduler is shutting down")
            raise

    async def _refresh(self) -> None:
        if self._released:
            return
        if any(t.dns for t in self._targets):
            resolved, errors = await asyncio.to_thread(resolve_all, self._targets, self._resolved)
        else:
            resolved, errors = resolve_all(self._targets, self._resolved)
        for target, error in errors.items():
            log.warning("executor name does not resolve", target=target, error=error)
        self._resolved = resolved
        wanted = list(dict.fromkeys(a for addresses in resolved.values() for a in addresses))
        for address in wanted:
            if address not in self._replicas:
                replica = ExecutorReplica(
                    address, self._transport_factory(address), self.config, self, self.scheduler_id
                )
                self._replicas[address] = replica
                replica.start()
                log.info("executor found", executor=address)
        for address in [a for a in self._replicas if a not in wanted]:
            log.info("executor vanished", executor=address)
            await self._drop(self._replicas[address], "dropped")

    async def _drop(self, replica: ExecutorReplica, state: str) -> None:
        """Stops using an executor for good: its requests move elsewhere, its lease is given up."""
        epoch = replica.lease_epoch
        await replica.stop(state)
        self._requeue(replica)
        if not self.is_serving:
            self._serving.clear()
        if epoch:
            await replica.detach(epoch)
        for name, value in replica.counters().items():
            self._dropped[name] = add_counter(self._dropped[name], value)
        del self._replicas[replica.address]
        with contextlib.suppress(Exception):
            await replica.transport.close()

    async def _stop_all(self, why: str) -> None:
        for replica in list(self._replicas.values()):
            await replica.stop("stopped")
        self._fail_all(EngineUnavailable(why))

    async def release_executors(self) -> None:
        """Gives every executor's lease up (`Executor.Detach`), so that other schedulers may attach
        them at once, and attaches no more. For a draining scheduler, once its streams are done:
        requests still held end with EngineUnavailable."""
        self._released = True
        for replica in list(self._replicas.values()):
            epoch = replica.lease_epoch
            await replica.stop("released")
            if epoch:
                await replica.detach(epoch)
            replica.seq_ids.clear()
        self._serving.clear()
        self._fail_all(EngineUnavailable("the scheduler released its executors (draining)"))

    def _fail_all(self, error: Exception) -> None:
        for active in self._active.values():
            active.deltas.put_nowait(error)
            active.replica = None
        self._active.clear()
        self._unplaced.clear()
