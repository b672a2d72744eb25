"""One executor behind the scheduler: its connection, its lease, its scheduling core and its Step loop.

An `ExecutorReplica` owns everything that belongs to one executor: the transport, the lease epoch,
the `Scheduler` core (block pool, prefix cache, swap pool: block ids mean nothing on another
executor) and the Step stream, with one plan in flight ahead of the executor (the plan of step N+1
is sent before the output of step N is read), so the executor never waits on this process. A stop
found late costs one discarded token, never streamed. Where no plan could go ahead (speculative
decoding's verification steps wait for their output), the next plan goes out before the output's
tokens are detokenized and streamed, which would otherwise hold the idle executor up.

Structured outputs: when plan N+1 names constrained requests whose masks follow it
(`StepPlan.late_masked_seq_ids`), their masks go out right after output N is processed, before
anything else is planned (`_send_late_masks`): the executor waits for them to sample N+1.

The request table, the router and the clients' streams belong to the `Engine` (scheduler/engine.py),
which the replica reaches through the small `ReplicaHost` interface: the replica says when it
attached, hands each step's output over, and reports its loss; the engine places requests on it
(`add_request`) and re-places them elsewhere when it is lost.

Its life: attach (retried at most once a second; a FAILED_PRECONDITION refusal, another scheduler's
live lease, is retried every refresh interval), run steps until the executor is lost (stream
ended, keepalive timeout, a refused step or heartbeat: fenced), then attach again. While idle it
sends `Heartbeat` every lease_timeout/3 so that its lease does not expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog
from asyncio_throttle import Throttler

from pagedserve.protos import executor_pb2
from pagedserve.scheduler.block_pool import BlockHash
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.core import LateMasks, Scheduler, SchedulerStats, StepPlan
from pagedserve.scheduler.kv_tier import LOAD_BUDGET_OVERRIDE, load_budget
from pagedserve.scheduler.request import Request, SeqId
from pagedserve.scheduler.router import ExecutorLoad
from pagedserve.scheduler.service_config import ServiceConfig
from pagedserve.scheduler.transport import ExecutorTransport

log = structlog.get_logger()

# Plans sent ahead of the output being read: the one executing and the one queued behind it.
PLANS_IN_FLIGHT = 2
ATTACH_RETRY_PERIOD_S = 1.0
# While idle, how often the loop checks that the executor's step stream is still up, so that it
# re-attaches to a restarted executor before the next request arrives.
IDLE_CHECK_PERIOD_S = 0.5
# Heartbeat, Detach: an executor that does not answer these in time is not serving anyway.
LEASE_RPC_TIMEOUT_S = 5.0
# The counters of SchedulerStats (never decreasing, kept when a core is retired).
COUNTERS = (
    "num_preemptions",
    "prompt_tokens_computed",
    "prefix_cache_hit_tokens",
    "prefix_cache_query_tokens",
    "cpu_prefix_cache_hit_tokens",
    "kv_offloaded_blocks",
    "kv_loaded_blocks",
    "kv_spilled_blocks",
    "kv_fetched_blocks",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_steps",
    "spec_accepted_per_pos",  # a tuple: summed position by position (`add_counter`)
)


def add_counter(a: int | tuple[int, ...], b: int | tuple[int, ...]) -> int | tuple[int, ...]:
    """a + b for a counter of COUNTERS: ints, or tuples of ints added position by position (0, the
    starting value, counts as the empty tuple)."""
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    a_t, b_t = (() if x == 0 else tuple(x) for x in (a, b))  # type: ignore[arg-type]
    longer, shorter = (a_t, b_t) if len(a_t) >= len(b_t) else (b_t, a_t)
    return tuple(x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer))


class LeaseLost(Exception):
    """The executor refused our lease (FAILED_PRECONDITION): another scheduler holds it now."""


@dataclass(frozen=True)
class ExecutorInfo:
    """What an executor reported on attach (max_model_len capped by --max-model-len)."""

    lease_epoch: int
    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    eos_token_ids: tuple[int, ...]
    device: str
    lease_timeout_ms: int = 0
    # Per KV-cache group (executor.kv_groups): None for full attention, else its sliding window.
    sliding_windows: tuple[int | None, ...] = (None,)
    num_cpu_offload_blocks: int = 0  # the CPU tier's share of num_cpu_blocks
    num_disk_offload_blocks: int = 0  # the disk tier's slots below the CPU tier
    bytes_per_block: int = 0
    # The read floor of a step (AttachResponse): passed on to Admin.ListExecutors for the bench.
    weight_read_bytes: int = 0
    kv_bytes_per_token: int = 0
    copy_bytes_per_s: float = 0.0
    host_copy_bytes_per_s: float = 0.0  # with a CPU tier: the tier's loads per plan (load_budget)
    # Speculative decoding's draft model, as loaded by the executor ("" and 0: none).
    draft_model: str = ""
    num_speculative_tokens: int = 0

    def mismatch(self, other: ExecutorInfo) -> str | None:
        """Why an executor reporting `other` cannot serve beside this one (None: it can). Requests
        move between executors, so everything a request was validated or tokenized against must
        agree."""
        for name in ("model", "max_model_len", "vocab_size", "block_size", "eos_token_ids"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} {theirs!r} differs from the other executors' {mine!r}"
        return None


@dataclass(frozen=True)
class ExecutorStatusView:
    """One executor as `Admin.ListExecutors` reports it (admin.proto's ExecutorStatus), plus the
    steps it ran and the sum of their StepOutput.step_seconds."""

    address: str
    attached: bool
    lease_epoch: int
    num_running: int
    num_waiting: int
    num_gpu_blocks: int
    gpu_blocks_in_use: int
    requests_routed: int
    prefix_cache_hit_tokens: int
    state: str
    steps: int
    busy_seconds: float
    cpu_tier_blocks: int = 0  # blocks its prefix cache's CPU tier holds now
    cpu_prefix_cache_hit_tokens: int = 0  # of the hits, tokens loaded from the tier
    kv_offloaded_bytes: int = 0  # GPU -> CPU tier, over the executor's life here
    kv_loaded_bytes: int = 0  # CPU tier -> GPU
    disk_tier_blocks: int = 0  # blocks its disk tier holds now
    kv_spilled_bytes: int = 0  # CPU tier -> disk tier
    kv_fetched_bytes: int = 0  # disk tier -> CPU tier
    weight_read_bytes: int = 0  # the read floor's inputs, as reported on attach (ExecutorInfo)
    kv_bytes_per_token: int = 0
    copy_bytes_per_s: float = 0.0


class ReplicaHost(Protocol):
    """What a replica needs from the engine."""

    def admit_executor(self, replica: ExecutorReplica, info: ExecutorInfo) -> str | None:
        """Why this executor must not be used (it serves another model), or None."""
        ...

    def has_slot(self, replica: ExecutorReplica) -> bool:
        """Whether --max-executors leaves room for this replica to attach."""
        ...

    def on_attached(self, replica: ExecutorReplica) -> None: ...

    def on_output(
        self, replica: ExecutorReplica, plan: StepPlan, output: executor_pb2.StepOutput
    ) -> Callable[[], None]:
        """Settles the output in the core; returns the delivery of its tokens to the clients."""
        ...

    def on_lost(self, replica: ExecutorReplica) -> None:
        """Called once the replica's core is retired: re-place `replica.seq_ids`."""
        ...

    def plan_to_proto(self, plan: StepPlan) -> executor_pb2.StepPlan: ...


def masks_to_proto(masks: LateMasks) -> executor_pb2.StepPlan:
    """The Step stream's message for late masks: a StepPlan carrying only its StepMasks, filled in
    place (`StepPlan(masks=StepMasks(...))` copies the submessage the slow way: 9 ms for 512 rows of
    a 128,256-token vocabulary, four times the rest of this message's cost)."""
    message = executor_pb2.StepPlan()
    out = message.masks
    out.step_id = masks.step_id
    out.seq_ids.extend(masks.seq_ids)
    out.token_bitmask = masks.token_bitmask.astype("<i4", copy=False).tobytes()
    out.rows.extend(masks.rows)
    return message


def _within(own: int, executor_limit: int) -> int:
    """A batch limit the executor accepts: ours, capped by its own (0 = it did not say)."""
    return min(own, executor_limit) if executor_limit else own


def _rpc_reason(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


class ExecutorReplica:
    """One executor's transport, lease, scheduling core and Step loop (see the module docstring).

    Public state, read by the engine and the admin API: `address`, `state`, `info`, `scheduler`
    (None unless attached), `seq_ids` (the unfinished requests placed here), `requests_routed`,
    `steps`, `busy_seconds`.
    """

    def __init__(
        self,
        address: str,
        transport: ExecutorTransport,
        config: ServiceConfig,
        host: ReplicaHost,
        scheduler_id: str,
    ) -> None:
        self.address = address
        self.transport = transport
        self.config = config
        self.scheduler_id = scheduler_id
        self._host = host
        self.state = "attaching"
        self.info: ExecutorInfo | None = None
        self.scheduler: Scheduler | None = None
        self.seq_ids: set[SeqId] = set()
        self.requests_routed = 0
        self.steps = 0
        self.busy_seconds = 0.0
        self.plans_in_flight: deque[StepPlan] = deque()  # sent, output not yet read (the step loop's)
        self._retired = dict.fromkeys(COUNTERS, 0)  # counters of this executor's earlier cores
        self._wakeup = asyncio.Event()
        self._heartbeats = True  # until the executor answers UNIMPLEMENTED
        self._task: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"ExecutorReplica({self.address}, {self.state})"

    @property
    def attached(self) -> bool:
        return self.scheduler is not None

    @property
    def lease_epoch(self) -> int:
        return self.info.lease_epoch if self.info is not None and self.attached else 0

    # ---- requests (called by the engine) ------------------------------------------------------

    def load(self, block_hashes: Sequence[BlockHash]) -> ExecutorLoad:
        """The router's view of this executor for a request whose prompt blocks hash to
        `block_hashes` (empty: no prefix lookup)."""
        core = self.scheduler
        assert core is not None
        manager = core.kv_cache_manager
        hit_blocks, cpu_hit_blocks = core.prefix_hit_blocks(block_hashes) if block_hashes else (0, 0)
        return ExecutorLoad(
            num_running=core.num_running_requests,
            num_waiting=core.num_queued_requests,
            queued_tokens=core.num_queued_tokens,
            num_free_blocks=manager.block_pool.num_free_blocks,
            block_size=manager.block_size,
            hit_blocks=hit_blocks,
            cpu_hit_blocks=cpu_hit_blocks,
        )

    def add_request(self, request: Request, block_hashes: Sequence[BlockHash] = ()) -> None:
        """Queues a request on this executor's core (ValueError: it does not fit its limits);
        `block_hashes` (its prompt's, from routing) let later requests find its prefix here."""
        assert self.scheduler is not None
        self.scheduler.add_request(request, block_hashes)
        self.seq_ids.add(request.seq_id)
        self.requests_routed += 1
        self._wakeup.set()

    def finish_request(self, seq_id: SeqId) -> None:
        """Drops a finished or aborted request; its blocks return to the pool."""
        self.seq_ids.discard(seq_id)
        if self.scheduler is not None:
            self.scheduler.abort_request(seq_id)
            self._wakeup.set()

    # ---- stats --------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """The core counters over this executor's lifetime (earlier cores included)."""
        totals = dict(self._retired)
        if self.scheduler is not None:
            stats = self.scheduler.stats
            for name in COUNTERS:
                totals[name] = add_counter(totals[name], getattr(stats, name))
        return totals

    def core_stats(self) -> SchedulerStats | None:
        return self.scheduler.stats if self.scheduler is not None else None

    def status(self) -> ExecutorStatusView:
        core = self.scheduler
        pool = core.kv_cache_manager.block_pool if core is not None else None
        counters = self.counters()
        block_bytes = self.info.bytes_per_block if self.info is not None else 0
        return ExecutorStatusView(
            address=self.address,
            attached=core is not None,
            lease_epoch=self.lease_epoch,
            num_running=core.num_running_requests if core is not None else 0,
            num_waiting=core.num_queued_requests if core is not None else 0,
            num_gpu_blocks=pool.num_blocks if pool is not None else 0,
            gpu_blocks_in_use=pool.num_blocks_in_use if pool is not None else 0,
            requests_routed=self.requests_routed,
            prefix_cache_hit_tokens=counters["prefix_cache_hit_tokens"],
            state=self.state,
            steps=self.steps,
            busy_seconds=self.busy_seconds,
            cpu_tier_blocks=core.stats.cpu_tier_blocks if core is not None else 0,
            cpu_prefix_cache_hit_tokens=counters["cpu_prefix_cache_hit_tokens"],
            kv_offloaded_bytes=counters["kv_offloaded_blocks"] * block_bytes,
            kv_loaded_bytes=counters["kv_loaded_blocks"] * block_bytes,
            disk_tier_blocks=core.stats.disk_tier_blocks if core is not None else 0,
            kv_spilled_bytes=counters["kv_spilled_blocks"] * block_bytes,
            kv_fetched_bytes=counters["kv_fetched_blocks"] * block_bytes,
            weight_read_bytes=self.info.weight_read_bytes if self.info is not None else 0,
            kv_bytes_per_token=self.info.kv_bytes_per_token if self.info is not None else 0,
            copy_bytes_per_s=self.info.copy_bytes_per_s if self.info is not None else 0.0,
        )

    # ---- life cycle ---------------------------------------------------------------------------

    def start(self) -> asyncio.Task:
        self._task = asyncio.create_task(self.run(), name=f"executor {self.address}")
        return self._task

    async def stop(self, state: str) -> None:
        """Stops the loop (the executor was dropped, or the scheduler releases it) and retires the
        core; the engine re-places `seq_ids` afterwards."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._retire_core()
        self.state = state

    async def detach(self, lease_epoch: int) -> None:
        """Gives the lease up (best effort: an executor that does not implement Detach, or does not
        answer, lets the lease expire instead)."""
        try:
            await self.transport.detach(lease_epoch, LEASE_RPC_TIMEOUT_S)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            log.info("detach failed", executor=self.address, error=_rpc_reason(exc))

    async def run(self) -> None:
        """Attaches, runs steps until the executor is lost, and again; until cancelled."""
        throttle = Throttler(rate_limit=1, period=ATTACH_RETRY_PERIOD_S)
        refresh = self.config.executor_refresh_interval
        while True:
            if not self._host.has_slot(self):
                self.state = "spare"
                await asyncio.sleep(min(ATTACH_RETRY_PERIOD_S, refresh))
                continue
            try:
                async with throttle:  # after a loss, re-attach at most once a period
                    reply = await self.transport.attach(self.scheduler_id, self.config.attach_timeout)
            except (grpc.aio.AioRpcError, RuntimeError) as exc:
                if (
                    isinstance(exc, grpc.aio.AioRpcError)
                    and exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                ):
                    self.state = f"refused: {exc.details()}"
                    log.info("executor refused", executor=self.address, reason=exc.details())
                    await asyncio.sleep(refresh)
                elif not self.state.startswith("lost"):
                    self.state = "attaching"
                    log.info("attach failed", executor=self.address, error=_rpc_reason(exc))
                continue
            info = self._info(reply)
            if not self._host.has_slot(self):  # another one attached meanwhile
                await self.detach(info.lease_epoch)
                continue
            refusal = self._host.admit_executor(self, info)
            if refusal is not None:
                self.state = f"refused: {refusal}"
                log.warning("executor refused", executor=self.address, reason=refusal)
                await self.detach(info.lease_epoch)
                await asyncio.sleep(refresh)
                continue
            self._start_core(reply, info)
            try:
                await self._step_loop()
            except (grpc.aio.AioRpcError, RuntimeError, LeaseLost) as exc:
                fenced = isinstance(exc, LeaseLost) or (
                    isinstance(exc, grpc.aio.AioRpcError)
                    and exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                )
                reason = ("lease lost: " if fenced else "") + _rpc_reason(exc)
                log.error("executor lost", executor=self.address, error=reason, requests=len(self.seq_ids))
                self._retire_core()
                self.state = f"lost: {reason}"
                self._host.on_lost(self)

    def _info(self, reply: executor_pb2.AttachResponse) -> ExecutorInfo:
        config = self.config
        return ExecutorInfo(
            lease_epoch=reply.lease_epoch,
            model=config.served_model_name or reply.model,
            max_model_len=min(reply.max_model_len, config.max_model_len or reply.max_model_len),
            vocab_size=reply.vocab_size,
            block_size=reply.block_size,
            num_gpu_blocks=reply.num_gpu_blocks,
            num_cpu_blocks=reply.num_cpu_blocks,
            eos_token_ids=tuple(reply.eos_token_ids),
            device=reply.device,
            lease_timeout_ms=reply.lease_timeout_ms,
            sliding_windows=tuple(g.sliding_window or None for g in reply.kv_cache_groups) or (None,),
            num_cpu_offload_blocks=reply.num_cpu_offload_blocks,
            num_disk_offload_blocks=reply.num_disk_offload_blocks,
            bytes_per_block=reply.bytes_per_block,
            weight_read_bytes=reply.weight_read_bytes,
            kv_bytes_per_token=reply.kv_bytes_per_token,
            copy_bytes_per_s=reply.copy_bytes_per_s,
            host_copy_bytes_per_s=reply.host_copy_bytes_per_s,
            draft_model=reply.draft_model,
            num_speculative_tokens=reply.num_speculative_tokens,
        )

    def _start_core(self, reply: executor_pb2.AttachResponse, info: ExecutorInfo) -> None:
        """A fresh scheduling core for a new lease: the executor holds no request of ours now."""
        config = self.config
        self.info = info
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=reply.block_size,
                num_gpu_blocks=reply.num_gpu_blocks,
                num_cpu_blocks=reply.num_cpu_blocks,
                max_model_len=info.max_model_len,
                max_num_seqs=_within(config.max_num_seqs, reply.max_num_seqs),
                max_num_batched_tokens=_within(config.max_num_batched_tokens, reply.max_num_batched_tokens),
                enable_prefix_caching=config.enable_prefix_caching,
                preemption_mode=config.preemption_mode,
                sliding_windows=info.sliding_windows,
                num_cpu_offload_blocks=info.num_cpu_offload_blocks if config.enable_prefix_caching else 0,
                num_disk_offload_blocks=info.num_disk_offload_blocks if config.enable_prefix_caching else 0,
                speculative=config.speculative_config,
                late_masks=reply.accepts_late_masks,
                shared_mask_rows=reply.accepts_shared_mask_rows,
                max_num_loaded_blocks=load_budget(
                    info.weight_read_bytes,
                    info.copy_bytes_per_s,
                    info.host_copy_bytes_per_s,
                    info.bytes_per_block,
                )
                if LOAD_BUDGET_OVERRIDE is None
                else LOAD_BUDGET_OVERRIDE,
            )
        )
        self._heartbeats = True
        self.state = "attached"
        log.info(
            "attached",
            executor=self.address,
            transport=str(self.transport),
            max_num_loaded_blocks=self.scheduler.config.max_num_loaded_blocks,
            **dataclasses.asdict(info),
        )
        self._host.on_attached(self)

    def _retire_core(self) -> None:
        """Keeps the core's counters and drops it: its block ids mean nothing to the next lease."""
        if self.scheduler is not None:
            stats = self.scheduler.stats
            for name in COUNTERS:
                self._retired[name] = add_counter(self._retired[name], getattr(stats, name))
            self.scheduler = None

    # ---- the step loop ------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        assert self.info is not None and self.scheduler is not None
        core = self.scheduler
        call = self.transport.open_steps(self.info.lease_epoch)
        in_flight = self.plans_in_flight = deque()
        deliver: Callable[[], None] | None = None  # the last output's tokens, not yet streamed
        self._last_contact = time.monotonic()
        try:
            while True:
                plan = None
                if len(in_flight) < PLANS_IN_FLIGHT:
                    plan = core.schedule()
                    if plan.is_empty:
                        plan = None
                    else:
                        await call.write(self._host.plan_to_proto(plan))
                        in_flight.append(plan)
                if deliver is not None:
                    run_delivery, deliver = deliver, None
                    run_delivery()
                if in_flight and (plan is None or len(in_flight) >= PLANS_IN_FLIGHT):
                    output = await call.read()
                    if output is None:
                        raise RuntimeError("the executor closed the step stream")
                    self._last_contact = time.monotonic()
                    deliver = self._on_output(in_flight.popleft(), output)
                    if in_flight:
                        await self._send_late_masks(call, core, in_flight[0])
                        run_delivery, deliver = deliver, None  # the executor is busy: now
                        run_delivery()
                elif not in_flight:
                    if call.ended():
                        raise RuntimeError("the executor ended the step stream while idle")
                    await self._heartbeat_if_due()
                    await self._wait_for_work()
        finally:
            call.cancel()
            self.plans_in_flight = deque()  # their outputs will not come
            if deliver is not None:  # settled in the core: its tokens reach their clients
                deliver()

    @staticmethod
    async def _send_late_masks(call, core: Scheduler, plan: StepPlan) -> None:
        """The masks behind `plan`, now that the output before it is processed (none: nothing)."""
        masks = core.fill_late_masks(plan)
        if masks is not None:
            await call.write(masks_to_proto(masks))

    def _heartbeat_period(self) -> float | None:
        assert self.info is not None
        if not self._heartbeats or not self.info.lease_timeout_ms:
            return None
        return self.info.lease_timeout_ms / 3000

    async def _heartbeat_if_due(self) -> None:
        """Keeps the lease of an idle executor live (steps keep it live while busy)."""
        period = self._heartbeat_period()
        if period is None or time.monotonic() - self._last_contact < period:
            return
        assert self.info is not None
        try:
            await self.transport.heartbeat(self.info.lease_epoch, LEASE_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._heartbeats = False  # an executor without leases that expire
                return
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LeaseLost(f"heartbeat refused: {exc.details()}") from None
            raise
        self._last_contact = time.monotonic()

    async def _wait_for_work(self) -> None:
        """Sleeps until a request is placed here or aborted (briefly, if queued work cannot run;
        at most `IDLE_CHECK_PERIOD_S`, so that the loop checks the stream and the heartbeat)."""
        assert self.scheduler is not None
        self._wakeup.clear()
        timeout = 0.05 if self.scheduler.has_unfinished_requests() else IDLE_CHECK_PERIOD_S
        period = self._heartbeat_period()
        if period is not None:
            timeout = max(0.0, min(timeout, self._last_contact + period - time.monotonic()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout)

    def _on_output(self, plan: StepPlan, output: executor_pb2.StepOutput) -> Callable[[], None]:
        if output.step_id != plan.step_id:
            raise RuntimeError(f"step output {output.step_id} arrived for plan {plan.step_id}")
        self.steps += 1
        self.busy_seconds += output.step_seconds
        return self._host.on_output(self, plan, output)
