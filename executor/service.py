"""The gRPC `pagedserve.v1.Executor` service around a `ModelRunner`.

One scheduler at a time holds the lease (`executor.lease`): `Attach` starts a new epoch and drops
every request of the previous one, and is refused with FAILED_PRECONDITION, naming the holder, while
another scheduler's lease is live. A lease stays live on plans and `Heartbeat`s; one that sees
neither for --lease-timeout seconds expires, and `Detach` ends one at once. A `Step` stream must
carry the current epoch in its `lease-epoch` metadata, and is cut with FAILED_PRECONDITION as soon as
its lease ends (superseded, expired or detached), even while idle. Whenever a lease ends the runner
forgets every request. Runner calls of all streams are serialised under a lock (the runner is not
thread-safe, and there is one GPU). A bad plan ends its stream with INVALID_ARGUMENT (state
untouched) and the service keeps serving.

Overlap: a Step stream's plans are read by a thread of their own into a queue, and the loop that
runs them launches plan N+1 *before* waiting for step N's sampled tokens whenever N+1 has arrived
by then, so the GPU goes from one step straight into the next. It never waits for a plan while a
step is finished: the scheduler, once it has nothing more to plan, waits for output N before it
sends anything, so holding output N back for plan N+1 would deadlock. Outputs leave in plan order.
A speculative verification step's plan always waits so (the scheduler must know what was
accepted): once its output is ready, and before it is sent, the runner launches the step that
plan most likely is (`ModelRunner.launch_ahead`), and the plan, when it comes, takes it or discards
it.

Masks behind the plan (structured outputs): a plan N+1 with late_masked_seq_ids is launched as it
arrives (its forward pass is queued) and output N goes out; then the loop waits for the message that
must come next, the StepMasks of N+1 (the scheduler sends it as soon as it has output N), samples
N+1 within them, and goes on as usual. Anything else in its place ends the stream with
INVALID_ARGUMENT; a stream that ends or is fenced meanwhile ends as any other, and the runner samples
the orphaned step without masks (`ModelRunner.drop_awaiting`), never sending its output. Shutting
down then does not wait for the masks: output N, the step in flight, has gone out already.

Operations: grpc.health.v1 reports SERVING once the server starts (the model is loaded before), for
"" and "pagedserve.v1.Executor"; `--metrics-port` serves Prometheus metrics (executor/metrics.py).
On SIGTERM the executor goes NOT_SERVING, finishes the step in flight (its output is sent), ends
its Step streams with UNAVAILABLE without launching another plan, and exits 0.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import structlog
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.common.auth import BearerTokenInterceptor, read_internal_token, warn_if_open
from pagedserve.common.flags import listen
from pagedserve.common.metrics_http import serve_metrics
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.lease import DEFAULT_LEASE_TIMEOUT_S, Lease, LeaseHeld, StaleLease
from pagedserve.executor.metrics import executor_registry
from pagedserve.executor.runner import ModelRunner, PendingStep, PlanError
from pagedserve.protos import executor_pb2, executor_pb2_grpc, wire

log = structlog.get_logger(__name__)

THROUGHPUT_LOG_SECONDS = 10.0
_END = object()  # the plan stream ended (closed, cancelled or broken)
_STEP_DONE = object()  # the pending step finished before another plan arrived
_WAKE = object()  # the service is shutting down: look at it
# How often, at most, the service looks for an expired lease (a fraction of the timeout, so a lease
# ends within a few percent of --lease-timeout).
LEASE_CHECK_MAX_PERIOD_S = 0.25


class _Fenced:
    """Put in a stream's plan queue when its lease ended: the stream ends with this message."""

    def __init__(self, message: str) -> None:
        self.message = message


class _StepDone:
    """Put in a stream's plan queue by its step watcher: `pending`'s device work has finished."""

    __slots__ = ("pending",)

    def __init__(self, pending: PendingStep) -> None:
        self.pending = pending


class _PlanReader:
    """Reads a Step stream's plans on a thread of its own, so the step loop can look for the next
    plan without blocking on the network. Each plan read keeps the stream's lease live.

    A launched step's end wakes the loop the same way: a watcher thread waits on the step's CUDA
    event (`ModelRunner._record_done`; torch releases the GIL while it waits) and puts a
    `_StepDone` in the queue, so the loop blocks on one queue for whichever comes first. (It
    polled the event every 200 us before: a finished step was noticed ~100 us late on average, on
    the critical path of every step nothing is planned ahead of, as a speculating request's.)"""

    def __init__(self, request_iterator: Iterator[executor_pb2.StepPlan], epoch: int, lease: Lease) -> None:
        self.epoch = epoch
        self._lease = lease
        self._plans: queue.Queue = queue.Queue()
        self._iterator = request_iterator
        self._watched: queue.Queue | None = None  # steps handed to the watcher (None: not started)
        self._watching: PendingStep | None = None  # the last of them
        threading.Thread(target=self._read, name="executor-plan-reader", daemon=True).start()

    def fence(self, message: str) -> None:
        """Ends the stream (at once if it is idle) with FAILED_PRECONDITION and `message`."""
        self._plans.put(_Fenced(message))

    def wake(self) -> None:
        """Makes a waiting `next` return `_WAKE` (the service is shutting down)."""
        self._plans.put(_WAKE)

    def _read(self) -> None:
        try:
            for plan in self._iterator:
                self._lease.touch(self.epoch)
                self._plans.put(plan)
        except Exception as e:  # noqa: BLE001 - a cancelled or broken stream just ends
            log.debug("executor.plan_stream_broken", error=type(e).__name__)
        finally:
            self._plans.put(_END)

    def queued(self) -> bool:
        """Whether something (a plan, most likely) waits to be read."""
        return not self._plans.empty()

    def close(self) -> None:
        """The stream ended: the watcher thread, if any, exits (after the step it waits for)."""
        if self._watched is not None:
            self._watched.put(None)

    def next(self, pending: PendingStep | None) -> object:
        """The next plan (or _END); with a step pending (not one that awaits its masks),
        _STEP_DONE as soon as it finished first: at once, if a plan is not queued already, for a
        step with no device work to wait for (on the CPU `launch` ran it to its end) or whose
        device work is done (a step launched ahead of its plan: the watcher's two thread
        hand-offs would come on top of the plan's round trip)."""
        finished = pending is not None and (pending.done is None or pending.done.query())
        if pending is not None and not finished and pending is not self._watching:
            self._watch(pending)
        while True:
            try:
                item = self._plans.get(block=not finished)
            except queue.Empty:
                return _STEP_DONE
            if not isinstance(item, _StepDone):
                return item
            if item.pending is pending:
                return _STEP_DONE
            # (a step whose output went out already: it finished while the loop launched another)

    def _watch(self, pending: PendingStep) -> None:
        """Hands `pending` to the watcher thread (started with the first)."""
        if self._watched is None:
            self._watched = queue.Queue()
            threading.Thread(target=self._wait_for_steps, name="executor-step-watcher", daemon=True).start()
        self._watching = pending
        self._watched.put(pending)

    def _wait_for_steps(self) -> None:
        """The watcher: waits for each handed step's event, in launch order, then wakes `next`."""
        assert self._watched is not None
        while (pending := self._watched.get()) is not None:
            try:
                _wait_for_event(pending.done)
            except Exception as e:  # noqa: BLE001 - the loop's own wait (`_finish`) raises it again
                log.warning("executor.step_watch_failed", step_id=pending.step_id, error=str(e))
            self._plans.put(_StepDone(pending))


def _wait_for_event(done: torch.cuda.Event) -> None:
    """Blocks until `done` has completed, its device made current first (the watcher thread would
    otherwise make a context on the default device for the wait; an event never recorded has no
    device, and nothing to wait for)."""
    if done.device is not None:
        torch.cuda.set_device(done.device)
    done.synchronize()


class _ThroughputLog:
    """Logs steps/s and tokens/s about every THROUGHPUT_LOG_SECONDS while steps keep coming."""

    def __init__(self, runner: ModelRunner, interval: float = THROUGHPUT_LOG_SECONDS) -> None:
        self._runner = runner
        self._interval = interval
        self._since = time.monotonic()
        self._last = (0, 0, 0, 0.0)

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._since < self._interval:
            return
        s = self._runner.stats
        current = (s.steps, s.tokens_computed, s.tokens_sampled, s.busy_seconds)
        steps, computed, sampled, busy = (a - b for a, b in zip(current, self._last, strict=True))
        elapsed = now - self._since
        log.info(
            "executor.throughput",
            steps_per_s=round(steps / elapsed, 2),
            tokens_per_s=round(computed / elapsed, 1),
            sampled_per_s=round(sampled / elapsed, 1),
            busy_fraction=round(busy / elapsed, 3),
            requests=self._runner.num_requests,
        )
        self._since, self._last = now, current


def attach_response(
    runner: ModelRunner, model_name: str, epoch: int, lease_timeout_s: float = 0.0
) -> executor_pb2.AttachResponse:
    """What a scheduler learns on attach: the model's limits and the KV layout the runner chose."""
    device = runner.device
    device_name = str(device)
    if device.type == "cuda":
        import torch

        device_name = f"{device} ({torch.cuda.get_device_name(device)})"
    if runner.tensor_parallel_size > 1:  # rank 0's device; the group spans the next ones too
        device_name += f", tensor parallel over {runner.tensor_parallel_size} devices"
    return executor_pb2.AttachResponse(
        lease_epoch=epoch,
        model=model_name,
        max_model_len=runner.max_model_len,
        vocab_size=runner.spec.vocab_size,
        block_size=runner.block_size,
        num_gpu_blocks=runner.kv_cache.num_device_blocks,
        num_cpu_blocks=runner.kv_cache.num_cpu_blocks,
        eos_token_ids=list(runner.spec.eos_token_ids),
        device=device_name,
        max_num_seqs=runner.max_num_seqs,
        max_num_batched_tokens=runner.max_num_batched_tokens,
        lease_timeout_ms=round(lease_timeout_s * 1000),
        kv_cache_groups=runner.kv_groups.to_proto(),
        num_cpu_offload_blocks=runner.num_cpu_offload_blocks,
        num_disk_offload_blocks=runner.kv_cache.num_disk_blocks,
        bytes_per_block=runner.kv_cache.layout.bytes_per_block,
        weight_read_bytes=runner.weight_read_bytes,
        kv_bytes_per_token=runner.kv_bytes_per_token,
        copy_bytes_per_s=runner.copy_bytes_per_s,
        host_copy_bytes_per_s=runner.host_copy_bytes_per_s,
        draft_model=runner.draft_model_dir,
        num_speculative_tokens=runner.num_speculative_tokens,
        accepts_late_masks=True,
        accepts_shared_mask_rows=True,
    )


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    """Leases, fencing and error mapping; the work itself is `ModelRunner.execute`.

    `close()` stops the thread that expires leases.
    """

    def __init__(
        self, runner: ModelRunner, model_name: str, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    ) -> None:
        self._runner = runner
        self._model_name = model_name
        self._lock = threading.Lock()  # the runner, and which streams are open
        self._lease = Lease(lease_timeout_s)
        self._streams: set[_PlanReader] = set()
        self._throughput = _ThroughputLog(runner)
        self._shutting_down = threading.Event()
        self._closed = threading.Event()
        period = min(LEASE_CHECK_MAX_PERIOD_S, lease_timeout_s / 20)
        self._expiry = threading.Thread(
            target=self._expire_leases, args=(period,), name="executor-lease-expiry", daemon=True
        )
        self._expiry.start()

    @property
    def epoch(self) -> int:
        """The current lease's epoch (0 = none)."""
        return self._lease.epoch

    @property
    def lease(self) -> Lease:
        return self._lease

    def close(self) -> None:
        """Stops the lease-expiry thread and waits for it: a thread still running when the
        interpreter exits can abort the process (std::terminate from a native library)."""
        self._closed.set()
        self._expiry.join(timeout=5)

    def shut_down(self) -> None:
        """Refuses new work: each Step stream finishes its step in flight, then ends with UNAVAILABLE."""
        self._shutting_down.set()
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.wake()

    def Attach(self, request: executor_pb2.AttachRequest, context: grpc.ServicerContext):
        peer = context.peer()
        if self._shutting_down.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is shutting down")
        if not request.scheduler_id:
            message = "AttachRequest.scheduler_id is empty: it names the lease holder"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        with self._lock:
            try:
                epoch, previous = self._lease.attach(request.scheduler_id, peer)
            except LeaseHeld as e:
                log.info("executor.attach_refused", scheduler_id=request.scheduler_id, peer=peer, why=str(e))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            self._end_streams(f"stale lease: a newer Attach (epoch {epoch}) superseded this stream")
        log.info(
            "executor.attach",
            scheduler_id=request.scheduler_id,
            lease_epoch=epoch,
            peer=peer,
            replaced=None if previous is None else str(previous),
        )
        return attach_response(self._runner, self._model_name, epoch, self._lease.timeout_s)

    def Heartbeat(self, request: executor_pb2.HeartbeatRequest, context: grpc.ServicerContext):
        try:
            self._lease.heartbeat(request.lease_epoch)
        except StaleLease as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return executor_pb2.HeartbeatResponse()

    def Detach(self, request: executor_pb2.DetachRequest, context: grpc.ServicerContext):
        with self._lock:
            try:
                holder = self._lease.detach(request.lease_epoch)
            except StaleLease as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            self._end_streams(f"lease epoch {holder.epoch} was detached")
        log.info("executor.detach", scheduler_id=holder.scheduler_id, lease_epoch=holder.epoch)
        return executor_pb2.DetachResponse()

    def _end_streams(self, message: str) -> None:
        """A lease ended (the caller holds the lock): the runner forgets every request, and every
        stream not of the current lease ends with `message`."""
        self._runner.reset()
        current = self._lease.epoch
        for stream in self._streams:
            if stream.epoch != current:
                stream.fence(message)

    def _expire_leases(self, period: float) -> None:
        while not self._closed.wait(period):
            left = self._lease.seconds_until_expiry()
            if left is None or left > 0:
                continue  # nothing to do, without waiting for a step to release the lock
            with self._lock:
                expired = self._lease.expire_if_due()
                if expired is not None:
                    self._end_streams(
                        f"lease epoch {expired.epoch} expired: no step or heartbeat for "
                        f"{self._lease.timeout_s:g} s (--lease-timeout)"
                    )

    def Step(
        self, request_iterator: Iterator[executor_pb2.StepPlan], context: grpc.ServicerContext
    ) -> Iterator[executor_pb2.StepOutput]:
        epoch = self._stream_epoch(context)
        with self._lock:  # checked and registered at once: an Attach in between would miss it
            self._check_lease(epoch, context)
            plans = _PlanReader(request_iterator, epoch, self._lease)
            self._streams.add(plans)
        try:
            yield from self._run_steps(plans, epoch, context)
        finally:
            plans.close()
            with self._lock:
                self._streams.discard(plans)

    def _run_steps(
        self, plans: _PlanReader, epoch: int, context: grpc.ServicerContext
    ) -> Iterator[executor_pb2.StepOutput]:
        pending: PendingStep | None = None  # launched, output not sent yet
        try:
            while True:
                awaits_masks = pending is not None and pending.awaits_masks
                item = plans.next(None if awaits_masks else pending)  # masks: wait for the message
                if item is _STEP_DONE:
                    output = self._finish(pending, epoch)
                    finished, pending = pending, None
                    error = None
                    if not plans.queued():  # the next plan waits for this output: start its step
                        # first, as sending holds this thread until the write is done (0.46 ms,
                        # the median on an H100 host, 2026-12-06): the GPU runs meanwhile
                        _, error = self._call_runner(
                            finished.step_id, epoch, context, self._runner.launch_ahead, finished
                        )
                    yield output
                    if error is not None:
                        context.abort(*error)
                    continue
                if item is _END or self._shutting_down.is_set():
                    if pending is not None and not awaits_masks:  # the step in flight: its output goes out
                        yield self._finish(pending, epoch)
                    if item is not _END:
                        context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is shutting down")
                    return
                if item is _WAKE:
                    continue
                if isinstance(item, _Fenced):  # the runner forgot the pending step's requests already
                    log.info("executor.stream_fenced", lease_epoch=epoch, reason=item.message)
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, item.message)
                if item.HasField("masks"):  # the late masks of the pending step: it samples now
                    step_id = pending.step_id if pending is not None else item.masks.step_id
                    _, error = self._call_runner(
                        step_id, epoch, context, self._apply_masks, pending, item.masks
                    )
                    if error is not None:
                        context.abort(*error)
                    continue
                launched, error = self._call_runner(item.step_id, epoch, context, self._runner.launch, item)
                if pending is not None and not awaits_masks:  # step N's output, after N+1 is queued
                    yield self._finish(pending, epoch)
                if error is not None:
                    context.abort(*error)
                pending = launched
        finally:
            if pending is not None and pending.awaits_masks:  # its masks will not come on this stream
                with self._lock:
                    self._runner.drop_awaiting(pending)

    def _apply_masks(self, pending: PendingStep | None, masks: executor_pb2.StepMasks) -> None:
        if pending is None:
            raise PlanError(f"masks for step {masks.step_id}, but no step awaits masks")
        self._runner.apply_masks(pending, masks)

    def _call_runner(self, step_id: int, epoch: int, context: grpc.ServicerContext, call, *args):
        """`call(*args)` on the runner under the lock, for step `step_id`: (its result, None), or
        (None, the status that ends the stream) if it failed."""
        with self._lock:
            self._check_lease(epoch, context)
            try:
                return call(*args), None
            except PlanError as e:
                log.warning("executor.bad_plan", step_id=step_id, error=str(e))
                return None, (grpc.StatusCode.INVALID_ARGUMENT, f"step {step_id}: {e}")
            except Exception as e:  # noqa: BLE001 - any failure must end the stream with a status
                log.exception("executor.step_failed", step_id=step_id)
                message = f"step {step_id} failed: {type(e).__name__}: {e}"
                return None, (grpc.StatusCode.INTERNAL, message)
            finally:
                # A long step (a big prefill on the CPU runs inside launch) must not cost its lease.
                self._lease.touch(epoch)

    def _finish(self, pending: PendingStep, epoch: int) -> executor_pb2.StepOutput:
        if pending.done is not None:
            pending.done.synchronize()  # outside the lock: Attach and other streams need not wait
        with self._lock:
            output = self._runner.finish(pending)
        self._lease.touch(epoch)
        self._throughput.tick()
        return output

    def GetStats(self, request: executor_pb2.GetStatsRequest, context: grpc.ServicerContext):
        """Counters for operators and benchmarks (the health check is grpc.health.v1)."""
        s = self._runner.stats
        return executor_pb2.ExecutorStats(
            steps=s.steps,
            tokens_computed=s.tokens_computed,
            tokens_sampled=s.tokens_sampled,
            swap_out_blocks=s.swap_out_blocks,
            swap_in_blocks=s.swap_in_blocks,
            busy_seconds=s.busy_seconds,
        )

    def _stream_epoch(self, context: grpc.ServicerContext) -> int:
        metadata = dict(context.invocation_metadata())
        raw = metadata.get(wire.LEASE_EPOCH_KEY)
        try:
            return int(raw)
        except (TypeError, ValueError):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Step needs the '{wire.LEASE_EPOCH_KEY}' metadata from Attach (got {raw!r})",
            )

    def _check_lease(self, epoch: int, context: grpc.ServicerContext) -> None:
        try:
            self._lease.check(epoch)
        except StaleLease as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))


class ExecutorServer:
    """A started gRPC server with its runner; `port` is the bound port (useful with port 0)."""

    def __init__(self, config: ExecutorConfig, runner: ModelRunner | None = None, max_workers: int = 16):
        self.config = config
        # The token and TLS files first: a bad one fails in a second, not after the model loaded.
        token = read_internal_token(config.internal_token_file)
        tls = config.server_tls()
        self._credentials = None if tls is None else tls.credentials()
        self._tp_workers = None
        if runner is None and config.tensor_parallel_size > 1:
            from pagedserve.executor.tp_workers import TensorParallelWorkers  # only for N > 1

            self._tp_workers = TensorParallelWorkers.start(config)
            runner = self._tp_workers.runner
        try:
            runner = runner if runner is not None else ModelRunner.create(config)
            self._init_server(config, runner, token, max_workers)
        except BaseException:
            if self._tp_workers is not None:
                self._tp_workers.kill()
            raise
        self.tls = tls is not None
        self.address = self._address.rsplit(":", 1)[0] + f":{self.port}"
        self._stop_metrics = None
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    def _init_server(
        self, config: ExecutorConfig, runner: ModelRunner, token: str | None, max_workers: int
    ) -> None:
        """The service around `runner` and the gRPC server, bound to its port (not started)."""
        self.runner = runner
        self.service = ExecutorService(self.runner, config.model, config.lease_timeout)
        warn_if_open(token, "executor")
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="executor-rpc"),
            options=wire.SERVER_OPTIONS,
            interceptors=[] if token is None else [BearerTokenInterceptor(token)],
        )
        executor_pb2_grpc.add_ExecutorServicer_to_server(self.service, self._server)
        address = f"{config.host}:{config.port}"
        if ":" in config.host and not config.host.startswith("["):
            address = f"[{config.host}]:{config.port}"
        self._address = address
        self.port = listen(self._server, address, self._credentials)

    def start(self) -> ExecutorServer:
        """Starts serving (the model is loaded by now: SERVING), and the metrics if asked."""
        if self.config.metrics_port is not None:
            registry = executor_registry(self.runner, self.config.model)
            self._stop_metrics = serve_metrics(registry, self.config.host, self.config.metrics_port)
        for service in ("", wire.EXECUTOR_HEALTH_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._server.start()
        log.info(
            "executor.serving", address=self.address, tls=self.tls, metrics_port=self.config.metrics_port
        )
        return self

    def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, every Step stream ended after its step in flight, then stops accepting RPCs
        and waits up to `grace` seconds for running ones."""
        self.health.enter_graceful_shutdown()
        self.service.shut_down()
        self._server.stop(grace).wait()
        self.service.close()
        if self._tp_workers is not None:
            self._tp_workers.stop()
        if self._stop_metrics is not None:
            self._stop_metrics()
        log.info("executor.stopped", address=self.address)

    def wait(self) -> None:
        self._server.wait_for_termination()


def serve(config: ExecutorConfig) -> None:
    """Loads the model, serves until SIGTERM/SIGINT, then drains in-flight steps and returns."""
    server = ExecutorServer(config).start()
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("executor.signal", signal=signal.Signals(signum).name)
        stopping.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    try:
        while not stopping.wait(timeout=1.0):
            pass
    finally:
        server.stop(grace=5.0)
