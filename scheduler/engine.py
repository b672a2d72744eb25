"""The step loop: plans steps with the scheduling core, streams them to the executor, and routes
the sampled tokens back to each request's client.

One `Engine` drives one executor over one long-lived bidirectional gRPC stream. It keeps one plan
in flight ahead of the executor (the plan of step N+1 is sent before the output of step N is read),
so the executor never waits on this process; the executor feeds each request's last sampled token
to its next step itself. A stop found late costs one discarded token, never streamed.

The connection to the executor is an `ExecutorTransport` (scheduler/transport.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from asyncio_throttle import Throttler

from pagedserve.protos import executor_pb2
from pagedserve.scheduler.completion import Completion, Delta, StopConditions
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.core import Scheduler, SchedulerStats, StepPlan
from pagedserve.scheduler.request import Request, SamplingOptions, SeqId
from pagedserve.scheduler.service_config import ServiceConfig
from pagedserve.scheduler.transport import ExecutorTransport, GrpcTransport

log = structlog.get_logger()

# Plans sent ahead of the output being read: the one executing and the one queued behind it.
PLANS_IN_FLIGHT = 2
STATS_LOG_INTERVAL_S = 10.0
ATTACH_RETRY_PERIOD_S = 1.0
# While idle, how often the engine checks that the executor's step stream is still up, so that it
# re-attaches to a restarted executor before the next request rather than failing that request.
IDLE_CHECK_PERIOD_S = 0.5


class EngineUnavailable(Exception):
    """No executor is attached (or it was lost): the request cannot be served now."""


class EngineFull(Exception):
    """The engine already holds max_queue_len requests."""


@dataclass(frozen=True)
class ExecutorInfo:
    """What the executor reported on attach."""

    lease_epoch: int
    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    eos_token_ids: tuple[int, ...]
    device: str


@dataclass(frozen=True)
class ExecutorStatusView:
    """One executor as operators see it: admin.proto's ExecutorStatus fields, plus the step count and
    the executor's busy time (the sum of its StepOutput.step_seconds) for the metrics."""

    address: str
    attached: bool
    lease_epoch: int
    num_running: int
    num_waiting: int
    num_gpu_blocks: int
    gpu_blocks_in_use: int
    requests_routed: int
    prefix_cache_hit_tokens: int
    state: str  # "attached", "attaching", "lost"
    steps: int
    busy_seconds: float


# The core's counters (the rest of SchedulerStats are gauges): `Engine.core_stats` keeps them
# growing across the fresh core each re-attach starts.
CORE_COUNTERS = (
    "num_preemptions",
    "prompt_tokens_computed",
    "prefix_cache_hit_tokens",
    "prefix_cache_query_tokens",
)


@dataclass(eq=False)
class ActiveRequest:
    """A request between submission and its last delta; the client reads `deltas`."""

    request_id: str
    request: Request
    completion: Completion
    deltas: asyncio.Queue[Delta | Exception] = field(default_factory=asyncio.Queue)
    held: Delta | None = None  # tokens not streamed yet (--stream-interval)

    @property
    def done(self) -> bool:
        return self.completion.finish_reason is not None

    def stream(self, delta: Delta, interval: int) -> None:
        """Queues `delta` for the client, or holds it until `interval` tokens are waiting; the
        first token (time to first token) and the last are never held."""
        if self.held is not None:
            delta = self.held.merged(delta)
        if (
            len(delta.token_ids) >= interval
            or delta.finish_reason is not None
            or self.completion.num_tokens == 1
        ):
            self.held = None
            self.deltas.put_nowait(delta)
        else:
            self.held = delta


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
            block_ids=r.block_ids,
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
        new_requests=[new_request(r) for r in plan.new_requests],
    )
    # One per running request every step: add() in place, and no empty block list to convert,
    # build them at a third of the cost of constructing each message.
    add_running = message.running.add
    for r in plan.running:
        if r.new_block_ids:
            add_running(seq_id=r.seq_id, num_new_tokens=r.num_new_tokens, new_block_ids=r.new_block_ids)
        else:
            add_running(seq_id=r.seq_id, num_new_tokens=r.num_new_tokens)
    return message


def _within(own: int, executor_limit: int) -> int:
    """A batch limit the executor accepts: ours, capped by its own (0 = it did not say)."""
    return min(own, executor_limit) if executor_limit else own


class Engine:
    """Owns the scheduling core, the executor stream and the table of active requests."""

    def __init__(
        self, config: ServiceConfig, tokenizer: Any, transport: ExecutorTransport | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.transport = transport if transport is not None else GrpcTransport(config.executor)
        self.info: ExecutorInfo | None = None
        self.scheduler: Scheduler | None = None
        self._active: dict[SeqId, ActiveRequest] = {}
        self._next_seq_id = 1
        self._wakeup = asyncio.Event()
        self._attached = asyncio.Event()
        self.steps = 0
        self.tokens_generated = 0
        self.busy_seconds = 0.0  # sum of the executor's StepOutput.step_seconds
        self.requests_routed = 0
        self._retired = dict.fromkeys(CORE_COUNTERS, 0)  # counters of the cores of earlier attaches
        self._lost = False

    # ---- attach -------------------------------------------------------------------------------

    async def attach(self, timeout: float | None = None) -> ExecutorInfo:
        """Takes the executor's lease, waiting for it to come up; starts a fresh scheduling core."""
        timeout = self.config.attach_timeout if timeout is None else timeout
        reply = await self.transport.attach(f"scheduler:{self.config.port}", timeout)
        max_model_len = min(reply.max_model_len, self.config.max_model_len or reply.max_model_len)
        self.info = ExecutorInfo(
            lease_epoch=reply.lease_epoch,
            model=self.config.served_model_name or reply.model,
            max_model_len=max_model_len,
            vocab_size=reply.vocab_size,
            block_size=reply.block_size,
            num_gpu_blocks=reply.num_gpu_blocks,
            num_cpu_blocks=reply.num_cpu_blocks,
            eos_token_ids=tuple(reply.eos_token_ids),
            device=reply.device,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=reply.block_size,
                num_gpu_blocks=reply.num_gpu_blocks,
                num_cpu_blocks=reply.num_cpu_blocks,
                max_model_len=max_model_len,
                max_num_seqs=_within(self.config.max_num_seqs, reply.max_num_seqs),
                max_num_batched_tokens=_within(
                    self.config.max_num_batched_tokens, reply.max_num_batched_tokens
                ),
                enable_prefix_caching=self.config.enable_prefix_caching,
                preemption_mode=self.config.preemption_mode,
            )
        )
        log.info("attached", executor=str(self.transport), **dataclasses.asdict(self.info))
        return self.info

    async def wait_until_attached(self) -> ExecutorInfo:
        """Returns once `run` has attached and requests can be submitted."""
        await self._attached.wait()
        assert self.info is not None
        return self.info

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    # ---- requests -----------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        stop: StopConditions,
        priority: int = 0,
    ) -> ActiveRequest:
        """Queues a validated request; its deltas arrive on the returned ActiveRequest."""
        if self.scheduler is None or not self._attached.is_set():
            raise EngineUnavailable("no executor is attached")
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
        )
        active = ActiveRequest(request_id, request, Completion(self.tokenizer, prompt_token_ids, stop))
        self._active[seq_id] = active
        self.scheduler.add_request(request)
        self.requests_routed += 1
        self._wakeup.set()
        return active

    def abort(self, active: ActiveRequest) -> None:
        """Drops a request whose client went away; its blocks return to the pool."""
        if self._active.pop(active.request.seq_id, None) is not None:
            if not active.done:
                active.completion.abort()
            if self.scheduler is not None:
                self.scheduler.abort_request(active.request.seq_id)
            self._wakeup.set()
            log.debug("aborted", request_id=active.request_id, seq_id=active.request.seq_id)

    # ---- the step loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Attaches, then runs steps until cancelled; re-attaches after losing the executor."""
        attach_throttle = Throttler(rate_limit=1, period=ATTACH_RETRY_PERIOD_S)
        while True:
            try:
                if self.scheduler is None:
                    async with attach_throttle:  # after a loss, re-attach at most once a period
                        await self.attach()
                self._attached.set()
                await self._step_loop()
            except asyncio.CancelledError:
                self._fail_all(EngineUnavailable("the scheduler is shutting down"))
                raise
            except (grpc.aio.AioRpcError, RuntimeError) as exc:
                self._attached.clear()
                details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.error("executor lost", error=details)
                self._fail_all(EngineUnavailable(f"executor lost: {details}"))
                self._retire_core()

    async def _step_loop(self) -> None:
        assert self.info is not None and self.scheduler is not None
        call = self.transport.open_steps(self.info.lease_epoch)
        in_flight: deque[StepPlan] = deque()
        last_log = time.monotonic()
        try:
            while True:
                plan = None
                if len(in_flight) < PLANS_IN_FLIGHT:
                    plan = self.scheduler.schedule()
                    if plan.is_empty:
                        plan = None
                    else:
                        await call.write(plan_to_proto(plan, self._active))
                        in_flight.append(plan)
                if in_flight and (plan is None or len(in_flight) >= PLANS_IN_FLIGHT):
                    output = await call.read()
                    if output is None:
                        raise RuntimeError("the executor closed the step stream")
                    self._on_output(in_flight.popleft(), output)
                elif not in_flight:
                    if call.ended():
                        raise RuntimeError("the executor ended the step stream while idle")
                    await self._wait_for_work()
                if time.monotonic() - last_log > STATS_LOG_INTERVAL_S:
                    last_log = time.monotonic()
                    self._log_stats()
        finally:
            call.cancel()

    async def _wait_for_work(self) -> None:
        """Sleeps until a request arrives or is aborted (briefly, if queued work cannot run; at most
        `IDLE_CHECK_PERIOD_S`, so that the step loop checks the stream)."""
        assert self.scheduler is not None
        self._wakeup.clear()
        timeout = 0.05 if self.scheduler.has_unfinished_requests() else IDLE_CHECK_PERIOD_S
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except TimeoutError:
            pass

    def _on_output(self, plan: StepPlan, output: executor_pb2.StepOutput) -> None:
        assert self.scheduler is not None
        if output.step_id != plan.step_id:
            raise RuntimeError(f"step output {output.step_id} arrived for plan {plan.step_id}")
        self.steps += 1
        self.busy_seconds += output.step_seconds
        seq_ids, token_ids = list(output.seq_ids), list(output.token_ids)
        self.scheduler.process_output(output.step_id, seq_ids, token_ids)
        logprobs = output.logprobs
        get_active = self._active.get
        interval = self.config.stream_interval
        for i, (seq_id, token_id) in enumerate(zip(seq_ids, token_ids, strict=True)):
            active = get_active(seq_id)
            if active is None:
                continue  # aborted
            completion = active.completion
            if completion.finish_reason is not None:
                continue  # the one discarded token after a late stop
            self.tokens_generated += 1
            logprob = logprobs[i] if active.request.sampling.return_logprobs else None
            delta = completion.add_token(token_id, logprob)
            active.stream(delta, interval)
            if delta.finish_reason is not None:
                del self._active[active.request.seq_id]
                self.scheduler.abort_request(active.request.seq_id)

    def _fail_all(self, error: Exception) -> None:
        for active in self._active.values():
            active.deltas.put_nowait(error)
        self._active.clear()

    def _log_stats(self) -> None:
        if self.scheduler is not None:
            log.info(
                "engine stats",
                steps=self.steps,
                tokens=self.tokens_generated,
                **dataclasses.asdict(self.scheduler.stats),
            )

    # ---- the interface operators' tools read (health, metrics, drain) -------------------------

    @property
    def is_serving(self) -> bool:
        """Whether an executor is attached, so that requests can be submitted."""
        return self.scheduler is not None and self._attached.is_set()

    def model_info(self) -> ExecutorInfo | None:
        """What the attached executor reported; None while none is attached."""
        return self.info if self.is_serving else None

    def core_stats(self) -> SchedulerStats:
        """The scheduling core's stats; its counters keep growing across re-attaches (each attach
        starts a fresh core), its gauges are those of the core now (zero while none is attached)."""
        if self.scheduler is not None:
            stats = self.scheduler.stats
        else:
            stats = SchedulerStats(0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0)
        for name, retired in self._retired.items():
            setattr(stats, name, getattr(stats, name) + retired)
        return stats

    def executor_statuses(self) -> list[ExecutorStatusView]:
        """One row per executor: here the one this engine drives."""
        stats = self.core_stats()
        attached = self.is_serving
        state = "attached" if attached else "lost" if self._lost else "attaching"
        return [
            ExecutorStatusView(
                address=str(self.transport),
                attached=attached,
                lease_epoch=self.info.lease_epoch if self.info is not None and attached else 0,
                num_running=stats.num_running,
                num_waiting=stats.num_waiting,
                num_gpu_blocks=stats.num_gpu_blocks,
                gpu_blocks_in_use=stats.gpu_blocks_in_use,
                requests_routed=self.requests_routed,
                prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens,
                state=state,
                steps=self.steps,
                busy_seconds=self.busy_seconds,
            )
        ]

    async def release_executors(self) -> None:
        """Gives the executors' leases up (a draining scheduler's last step). With one executor and
        no lease expiry yet, nothing to do: the executor takes the next Attach."""

    def _retire_core(self) -> None:
        """Drops the core of a lost executor, keeping its counters."""
        if self.scheduler is not None:
            stats = self.scheduler.stats
            for name in CORE_COUNTERS:
                self._retired[name] += getattr(stats, name)
        self.scheduler = None
        self._lost = True
