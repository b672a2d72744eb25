"""The executor's side of the step protocol in the scheduler's process: no gRPC, no ports.

The offline `LLM` API and `pagedserve bench --in-process` both run the scheduler's own `Engine` on
the executor's own `ModelRunner` through `InProcessTransport`, on one asyncio loop: this is the one
in-process path, so what it costs against the two services is the price of the split and nothing
else.
"""

from __future__ import annotations

import asyncio
from collections import deque

from pagedserve.executor.runner import ModelRunner, PendingStep
from pagedserve.executor.service import attach_response
from pagedserve.protos import executor_pb2
from pagedserve.scheduler.transport import StepStream


class InProcessTransport:
    """The executor's side of the step protocol, called directly: no serialization, no network.

    Attach does what `ExecutorService.Attach` does (new epoch, runner reset). A step stream keeps
    the service's overlap: a plan is launched as soon as it is written, so when the engine writes
    plan N+1 before reading output N (it keeps PLANS_IN_FLIGHT plans out) step N+1 is queued on
    the device before step N's tokens are waited for. Failures raise RuntimeError, which the engine
    handles as it handles a gRPC error: it re-attaches and recomputes the requests it held.
    """

    def __init__(self, runner: ModelRunner, model_name: str) -> None:
        self.runner = runner
        self.model_name = model_name
        self.epoch = 0

    def __str__(self) -> str:
        return f"in-process ({self.runner.device})"

    async def attach(self, scheduler_id: str, timeout: float | None) -> executor_pb2.AttachResponse:
        self.epoch += 1
        self.runner.reset()
        return attach_response(self.runner, self.model_name, self.epoch)

    def open_steps(self, lease_epoch: int) -> StepStream:
        return _InProcessSteps(self, lease_epoch)

    async def heartbeat(self, lease_epoch: int, timeout: float) -> None:
        pass  # the lease of an in-process runner never expires (attach reports no timeout)

    async def detach(self, lease_epoch: int, timeout: float) -> None:
        pass

    async def close(self) -> None:
        pass


class _InProcessSteps:
    def __init__(self, transport: InProcessTransport, lease_epoch: int) -> None:
        self._transport = transport
        self._epoch = lease_epoch
        self._pending: deque[PendingStep] = deque()  # launched, output not read yet, in plan order
        self._cancelled = False

    async def write(self, plan: executor_pb2.StepPlan) -> None:
        if self._cancelled or self._epoch != self._transport.epoch:
            raise RuntimeError(f"step stream of lease {self._epoch} is closed or superseded")
        runner = self._transport.runner
        try:
            if plan.HasField("masks"):  # the late masks of the last plan launched (it samples now)
                if not self._pending:
                    raise ValueError(f"masks for step {plan.masks.step_id}, but no step awaits masks")
                runner.apply_masks(self._pending[-1], plan.masks)
            else:
                self._pending.append(runner.launch(plan))
        except Exception as e:  # a bad plan or a failed step ends the stream, as in the service
            raise RuntimeError(f"step {plan.step_id} failed: {type(e).__name__}: {e}") from e

    async def read(self) -> executor_pb2.StepOutput | None:
        """Finishes the oldest launched step. Every written plan is already launched, so the
        device has the next step queued while this one's tokens are awaited."""
        if self._cancelled or not self._pending:
            return None
        pending = self._pending[0]
        if pending.awaits_masks:  # the engine sends them before it reads: it never will now
            raise RuntimeError(f"step {pending.step_id}'s output was read before its masks were sent")
        # Yield to the clients' tasks at least once per step, as a gRPC read does, and for as long
        # as the device works. A timed sleep would round up to epoll's 1 ms on every step, and a
        # thread hop per step costs more than polling the event.
        await asyncio.sleep(0)
        while not pending.ready():
            await asyncio.sleep(0)
        self._pending.popleft()
        return self._transport.runner.finish(pending)

    def cancel(self) -> None:
        self._cancelled = True
        for pending in self._pending:  # a step awaiting masks is sampled without them
            self._transport.runner.drop_awaiting(pending)
        self._pending.clear()  # the runner forgets their requests on the next attach

    def ended(self) -> bool:
        return self._cancelled  # the runner lives in this process: it cannot go away alone
