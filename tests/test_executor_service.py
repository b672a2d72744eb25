"""The real gRPC executor on a loopback port: attach, stream steps, lease fencing, errors, swap."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from pagedserve.bench.launch import free_port
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.service import ExecutorServer
from pagedserve.protos import executor_pb2, executor_pb2_grpc, wire
from tests.toy_scheduler import ToyScheduler

NUM_BLOCKS = 48
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = ExecutorConfig(
        model=str(tiny_model_dir), host="127.0.0.1", port=0, device="cpu",
        num_gpu_blocks_override=NUM_BLOCKS, swap_space=0.002, max_model_len=256,
    )  # fmt: skip
    server = ExecutorServer(config).start()
    yield server
    server.stop(grace=1)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield executor_pb2_grpc.ExecutorStub(channel)


class StepStream:
    """One Step stream driven plan by plan (the request iterator blocks on a queue)."""

    def __init__(self, stub: executor_pb2_grpc.ExecutorStub, epoch: int | None) -> None:
        self._plans: queue.Queue = queue.Queue()
        metadata = () if epoch is None else wire.lease_metadata(epoch)
        self._outputs = stub.Step(iter(self._plans.get, None), metadata=metadata, timeout=60)

    def step(self, plan: executor_pb2.StepPlan) -> executor_pb2.StepOutput:
        self._plans.put(plan)
        return next(self._outputs)

    def send(self, plan: executor_pb2.StepPlan) -> None:
        """Sends a plan without reading (the next plan goes out while its output is pending)."""
        self._plans.put(plan)

    def read(self) -> executor_pb2.StepOutput:
        return next(self._outputs)

    def close(self) -> None:
        self._plans.put(None)


def _attach(stub) -> executor_pb2.AttachResponse:
    return stub.Attach(executor_pb2.AttachRequest(scheduler_id="test"))


def test_attach_describes_the_executor(stub, tiny_model_dir):
    info = _attach(stub)
    assert info.lease_epoch > 0
    assert info.model == str(tiny_model_dir)
    assert (info.max_model_len, info.vocab_size, info.block_size) == (256, 512, 16)
    assert info.num_gpu_blocks == NUM_BLOCKS
    assert info.num_cpu_blocks > 0
    assert list(info.eos_token_ids) == [2]
    assert info.device == "cpu"
    assert _attach(stub).lease_epoch > info.lease_epoch


def _generate(
    stub, prompts: dict[int, list[int]], max_new: int, swap_at: int | None = None
) -> dict[int, list[int]]:
    """Greedy generation over one stream; with swap_at, seq 1 is swapped out after that many tokens,
    its blocks are reused by a newcomer (seq 9), then it is swapped back in and resumed."""
    info = _attach(stub)
    sched = ToyScheduler(info.num_gpu_blocks, info.num_cpu_blocks, info.block_size, seed=1)
    for seq_id, prompt in prompts.items():
        sched.add(seq_id, prompt)
    stream = StepStream(stub, info.lease_epoch)
    try:
        swapped = False
        while min(len(sched.seqs[s].generated) for s in prompts) < max_new:
            if swap_at is not None and not swapped and len(sched.seqs[1].generated) == swap_at:
                others = {s: 1 for s in prompts if s != 1}
                sched.observe(stream.step(sched.plan(others, swap_out=[1])))
                sched.add(9, list(range(3, 40)))
                sched.observe(stream.step(sched.plan({**others, 9: 37})))
                sched.observe(stream.step(sched.plan(others, remove=[9])))
                del sched.seqs[9]
                sched.observe(stream.step(sched.plan(swap_in=[1])))
                swapped = True
                continue
            sched.observe(stream.step(sched.plan()))
    finally:
        stream.close()
    return {s: sched.seqs[s].generated[:max_new] for s in prompts}


PROMPTS = {1: [5, 17, 99, 3, 250, 7, 7, 31, 400, 12, 8, 64, 65, 66, 67, 90, 91, 92, 11], 2: [42, 43, 44]}


def test_swap_round_trip_equals_uninterrupted_generation(stub, server):
    before = stub.GetStats(executor_pb2.GetStatsRequest())
    plain = _generate(stub, PROMPTS, max_new=12)
    swapped = _generate(stub, PROMPTS, max_new=12, swap_at=5)
    assert swapped == plain
    stats = stub.GetStats(executor_pb2.GetStatsRequest())
    assert stats.swap_out_blocks - before.swap_out_blocks == 2  # 19 prompt + 5 generated tokens
    assert stats.swap_in_blocks - before.swap_in_blocks == 2
    assert stats.tokens_sampled > before.tokens_sampled
    assert stats.busy_seconds > 0


def test_stale_or_missing_epoch_is_refused(stub):
    old = _attach(stub).lease_epoch
    current = _attach(stub).lease_epoch
    for epoch in (old, None):
        stream = StepStream(stub, epoch)
        with pytest.raises(grpc.RpcError) as err:
            stream.step(executor_pb2.StepPlan(step_id=1))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stream = StepStream(stub, current)
    assert stream.step(executor_pb2.StepPlan(step_id=7)).step_id == 7
    _attach(stub)  # a newer scheduler takes the lease: the open stream is cut at its next plan
    with pytest.raises(grpc.RpcError) as err:
        stream.step(executor_pb2.StepPlan(step_id=8))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale lease" in err.value.details()


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (
            executor_pb2.StepPlan(running=[executor_pb2.RunningRequest(seq_id=77, num_new_tokens=1)]),
            "unknown",
        ),
        (
            executor_pb2.StepPlan(
                new_requests=[
                    executor_pb2.NewRequest(
                        seq_id=3,
                        token_ids=[4, 5],
                        num_new_tokens=2,
                        block_tables=[executor_pb2.BlockTable(block_ids=[NUM_BLOCKS])],
                    )
                ]
            ),
            "out of range",
        ),
    ],
)
def test_bad_plan_is_invalid_argument_and_server_keeps_serving(stub, plan, message):
    epoch = _attach(stub).lease_epoch
    stream = StepStream(stub, epoch)
    with pytest.raises(grpc.RpcError) as err:
        stream.step(plan)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    stream = StepStream(stub, epoch)  # same lease, new stream
    ok = executor_pb2.NewRequest(
        seq_id=3, token_ids=[4, 5], num_new_tokens=2, block_tables=[executor_pb2.BlockTable(block_ids=[0])]
    )
    out = stream.step(executor_pb2.StepPlan(step_id=2, new_requests=[ok]))
    assert list(out.seq_ids) == [3]
    assert out.step_seconds > 0
    stream.close()


def _prefill(step_id: int) -> executor_pb2.StepPlan:
    new = [
        executor_pb2.NewRequest(
            seq_id=s,
            token_ids=[5, 17, 99, s],
            num_new_tokens=4,
            block_tables=[executor_pb2.BlockTable(block_ids=[s])],
        )
        for s in (1, 2)
    ]
    return executor_pb2.StepPlan(step_id=step_id, new_requests=new)


def _decode(step_id: int, seq_ids=(1, 2), late=()) -> executor_pb2.StepPlan:
    running = [executor_pb2.RunningRequest(seq_id=s, num_new_tokens=1) for s in seq_ids]
    return executor_pb2.StepPlan(step_id=step_id, running=running, late_masked_seq_ids=late)


def _only(token: int, vocab: int = 512) -> bytes:
    """A packed mask row allowing one token."""
    words = [0] * ((vocab + 31) // 32)
    words[token // 32] = 1 << (token % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_late_masks_are_awaited_after_the_previous_output_and_nothing_may_come_first(stub):
    """Masks behind the plan over the wire: output 1 goes out while plan 2 awaits its masks; the
    StepMasks samples plan 2 within them; a plan sent in their place ends the stream, and the same
    lease's next stream runs (the orphaned step was sampled without its masks)."""
    epoch = _attach(stub).lease_epoch
    stream = StepStream(stub, epoch)
    stream.send(_prefill(1))
    stream.send(_decode(2, late=[1]))
    assert stream.read().step_id == 1  # before the masks are sent
    masks = executor_pb2.StepMasks(step_id=2, seq_ids=[1], token_bitmask=_only(300))
    out = stream.step(executor_pb2.StepPlan(masks=masks))
    assert out.step_id == 2 and dict(zip(out.seq_ids, out.token_ids, strict=True))[1] == 300
    stream.send(_decode(3, late=[1, 2]))
    with pytest.raises(grpc.RpcError) as err:
        stream.step(_decode(4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "awaits its late masks" in err.value.details()
    stream = StepStream(stub, epoch)
    assert list(stream.step(_decode(5)).seq_ids) == [1, 2]
    stream.close()


def test_a_stream_closed_while_a_step_awaits_its_masks_ends_without_hanging(stub):
    epoch = _attach(stub).lease_epoch
    stream = StepStream(stub, epoch)
    stream.send(_prefill(1))
    stream.send(_decode(2, late=[2]))
    assert stream.read().step_id == 1
    stream.close()  # the scheduler went away: its masks will never come
    with pytest.raises(StopIteration):
        stream.read()
    stream = StepStream(stub, epoch)
    assert list(stream.step(_decode(3)).seq_ids) == [1, 2]
    stream.close()


def test_python_m_executor_serves_and_stops_on_sigterm(tiny_model_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.executor", "--model", str(tiny_model_dir), "--port", str(port)]
    cmd += "--device cpu --num-gpu-blocks-override 64 --swap-space 0.01".split()
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "PAGEDSERVE_LOG_FORMAT": "json"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            while True:
                try:
                    stub.GetStats(executor_pb2.GetStatsRequest(), timeout=1)  # the health check
                    break
                except grpc.RpcError:
                    assert proc.poll() is None, "executor did not come up"
                    assert time.monotonic() < deadline, "executor did not come up"
                    time.sleep(0.2)
            assert _attach(stub).num_gpu_blocks == 64
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        logs = proc.stdout.read()
        assert '"event": "executor.loaded"' in logs
        assert '"event": "executor.attach"' in logs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the step loop's wake: a watcher thread on the step's event, no polling ---------------------


class _FakeEvent:
    """Stands for a step's CUDA event: `synchronize` blocks until the test calls `complete`."""

    device = None  # (as an unrecorded CUDA event's: no device is made current to wait for it)

    def __init__(self) -> None:
        self._done = threading.Event()
        self.waits = 0

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.waits += 1
        self._done.wait()


class _Lease:
    def touch(self, epoch: int) -> None:
        pass


def _reader():
    """A _PlanReader over a queue the test feeds (None ends the stream)."""
    from pagedserve.executor import service

    incoming: queue.Queue = queue.Queue()
    reader = service._PlanReader(iter(incoming.get, None), 1, _Lease())
    return reader, incoming


def _pending(step_id: int, done: _FakeEvent | None):
    from pagedserve.executor.runner import PendingStep

    return PendingStep(step_id, time.perf_counter(), done=done)


def _next_in_thread(reader, pending) -> queue.Queue:
    """Calls reader.next(pending) on a thread; its result arrives in the returned queue."""
    result: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: result.put(reader.next(pending)), daemon=True).start()
    return result


def test_the_loop_wakes_on_the_steps_event_and_on_a_plan_whichever_comes_first():
    """With a step in flight, `next` blocks (no poll) until its event completes (the watcher
    thread's wake: _STEP_DONE) or a plan arrives (the plan); a wake of a step whose output went
    out already is ignored; the end of the stream still ends it; `close` ends the watcher."""
    from pagedserve.executor import service

    reader, incoming = _reader()
    first = _pending(1, _FakeEvent())
    result = _next_in_thread(reader, first)
    time.sleep(0.05)
    assert result.empty()  # still running: nothing to return
    first.done.complete()
    assert result.get(timeout=5) is service._STEP_DONE
    # A plan arrives while step 2 runs: the plan first; step 2's wake is for the call after.
    second = _pending(2, _FakeEvent())
    result = _next_in_thread(reader, second)
    time.sleep(0.05)
    plan = executor_pb2.StepPlan(step_id=3)
    incoming.put(plan)
    assert result.get(timeout=5) == plan
    assert second.done.waits == 1
    # Step 3 launched, step 2's output sent by the loop (it finished meanwhile): its late wake is
    # not step 3's end.
    second.done.complete()
    third = _pending(3, _FakeEvent())
    result = _next_in_thread(reader, third)
    time.sleep(0.05)
    assert result.empty()
    reader.wake()  # (shutting down: the loop looks, then asks about the same step again)
    assert result.get(timeout=5) is service._WAKE
    result = _next_in_thread(reader, third)
    third.done.complete()
    assert result.get(timeout=5) is service._STEP_DONE
    assert third.done.waits == 1  # watched once, however often `next` is asked about it
    incoming.put(None)
    assert reader.next(None) is service._END
    reader.close()
    watchers = [t for t in threading.enumerate() if t.name == "executor-step-watcher"]
    for t in watchers:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in watchers)


def test_a_step_with_nothing_to_wait_for_is_done_at_once_unless_a_plan_is_queued():
    """The CPU path (`done` None: launch ran the step to its end): `next` returns a plan already
    queued, else _STEP_DONE at once, without waiting, and starts no watcher."""
    from pagedserve.executor import service

    reader, incoming = _reader()
    step = _pending(1, None)
    start = time.perf_counter()
    assert reader.next(step) is service._STEP_DONE
    assert time.perf_counter() - start < 0.05
    plan = executor_pb2.StepPlan(step_id=2)
    incoming.put(plan)
    deadline = time.monotonic() + 5
    while reader._plans.empty() and time.monotonic() < deadline:  # the reader thread's put
        time.sleep(0.001)
    assert reader.next(step) == plan
    assert reader._watched is None
    incoming.put(None)
    assert reader.next(None) is service._END
