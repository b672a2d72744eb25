"""The executor's fast path on the CPU: device-side token feed with one plan in flight ahead,
the persistent slot block table, padded (CUDA-graph shaped) decode batches, and the overlapped
service loop's ordering."""

from __future__ import annotations

import os
import queue
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.cuda_graphs import StepGraphs, decode_graph_sizes, mixed_graph_sizes
from pagedserve.executor.runner import ModelRunner, PendingStep, RunnerStats
from pagedserve.executor.service import ExecutorService
from pagedserve.executor.transfer import pack_int64
from pagedserve.protos import executor_pb2, wire
from tests.toy_scheduler import AheadScheduler, ToyScheduler, drive_ahead

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    config = ExecutorConfig(
        model=str(tiny_model_dir), device="cpu", num_gpu_blocks_override=NUM_BLOCKS, swap_space=0.002,
        max_model_len=256, max_num_seqs=8,
    )  # fmt: skip
    return ModelRunner.create(config)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0, min_length=0
    )
    return out[0, len(prompt) :].tolist()


def test_one_plan_ahead_matches_hf(runner, hf_model):
    """Decode inputs come from the device's last_token: planned before their values are known.
    Prompts are admitted in different steps (budget 40), so steps mix prefills and decodes."""
    runner.reset()
    prompts = {1: _prompt(21, seed=1), 2: _prompt(16, seed=2), 3: _prompt(3, seed=3)}
    sched = AheadScheduler(NUM_BLOCKS, runner.block_size, max_num_batched_tokens=40)
    for seq_id, prompt in prompts.items():
        sched.add(seq_id, prompt)
    drive_ahead(runner, sched, steps=20)
    for seq_id, prompt in prompts.items():
        got = sched.outputs[seq_id]
        assert len(got) >= 18, seq_id
        assert got == _hf_greedy(hf_model, prompt, len(got)), seq_id


def _check_tables(runner: ModelRunner, sched: ToyScheduler) -> None:
    """Host mirror == device table, and each held request's row starts with its block ids."""
    assert torch.equal(runner.slots.table, torch.from_numpy(runner.slots.table_host))
    slots = set()
    for seq in sched.seqs.values():
        if seq.held:
            state = runner._requests[seq.seq_id]
            slots.add(state.slot)
            assert runner.slots.table_host[0, state.slot, : len(seq.block_ids)].tolist() == seq.block_ids
    assert len(slots) == runner.num_requests  # no two requests share a slot


def test_block_table_stays_right_across_removal_readd_and_swap(runner, hf_model):
    runner.reset()
    sched = ToyScheduler(NUM_BLOCKS, runner.kv_cache.num_cpu_blocks, runner.block_size, seed=7)
    prompts = {1: _prompt(30, seed=4), 2: _prompt(9, seed=5), 3: _prompt(14, seed=6)}
    for seq_id, prompt in prompts.items():
        sched.add(seq_id, prompt)
    for _ in range(5):
        sched.observe(runner.execute(sched.plan()))
        _check_tables(runner, sched)
    sched.observe(runner.execute(sched.plan({2: 1, 3: 1}, swap_out=[1])))  # 1 leaves its slot
    _check_tables(runner, sched)
    sched.observe(runner.execute(sched.plan({2: 1}, remove=[3])))  # 3 leaves too
    sched.add(4, _prompt(40, seed=7))  # reuses a freed slot and freed blocks
    sched.observe(runner.execute(sched.plan({2: 1, 4: 40})))
    _check_tables(runner, sched)
    sched.observe(runner.execute(sched.plan({2: 1, 4: 1, 1: 1}, swap_in=[1])))
    sched.observe(runner.execute(sched.plan({2: 1, 4: 1, 3: len(sched.seqs[3].token_ids)})))
    _check_tables(runner, sched)
    while min(len(sched.seqs[s].generated) for s in prompts) < 14:
        sched.observe(runner.execute(sched.plan()))
        _check_tables(runner, sched)
    for seq_id, prompt in prompts.items():
        assert sched.seqs[seq_id].generated[:14] == _hf_greedy(hf_model, prompt, 14), seq_id


def test_slots_are_limited_to_max_num_seqs(runner):
    from pagedserve.executor.runner import PlanError

    runner.reset()
    new = [
        executor_pb2.NewRequest(
            seq_id=i, token_ids=[5], num_new_tokens=1, block_tables=[executor_pb2.BlockTable(block_ids=[i])]
        )
        for i in range(9)
    ]
    with pytest.raises(PlanError, match="max_num_seqs"):
        runner.execute(executor_pb2.StepPlan(new_requests=new))
    assert runner.slots.num_free == 8


def test_graph_sizes():
    assert decode_graph_sizes(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_graph_sizes(256)[-3:] == [224, 240, 256]
    assert decode_graph_sizes(6) == [1, 2, 4, 6]
    mixed = mixed_graph_sizes(8192, 256, 8192)
    assert mixed[:3] == [128, 256, 384]
    assert mixed[15:18] == [2048, 2304, 2560]
    assert mixed[-2:] == [7680, 8192]
    assert len(mixed) == 32
    # The end never exceeds what max_num_seqs sequences of max_model_len can hold.
    assert mixed_graph_sizes(64, 8, 48) == [64]
    assert mixed_graph_sizes(8192, 4, 100) == [128, 256, 384, 400]


def _graphs(runner: ModelRunner, decode_sizes: list[int], mixed_sizes: list[int]) -> StepGraphs:
    return StepGraphs(runner.model, runner.kv_cache.layer_caches(), runner.slots, decode_sizes, mixed_sizes)


def test_mixed_graph_sequence_slots_never_equal_a_token_count(runner):
    """A mixed graph with as many tokens as sequence slots would run the decode kernel: the slot
    count (max_num_seqs + 1 = 9 here) moves past every mixed token count."""
    assert _graphs(runner, [1, 2], [16, 32]).num_seq_slots == 9
    assert _graphs(runner, [1, 2], [9, 10, 16]).num_seq_slots == 11


def _written_blocks(runner: ModelRunner, pool_before: torch.Tensor) -> set[int]:
    written = (runner.kv_cache.device_pool != pool_before).flatten(0, 1).any(dim=(0, 2, 3, 4))
    return set(torch.nonzero(written).flatten().tolist())


def test_padded_decode_batch_equals_eager(runner):
    """What a CUDA graph computes for 3 sequences padded to 4 (CPU, no capture): the same logits
    as the eager step, and the padding row writes no KV anywhere."""
    runner.reset()
    sched = ToyScheduler(NUM_BLOCKS, 0, runner.block_size, seed=9)
    for seq_id, n in ((1, 17), (2, 5), (3, 33)):
        sched.add(seq_id, _prompt(n, seed=seq_id))
    sched.observe(runner.execute(sched.plan()))  # prefill; next step is decode-only
    graphs = _graphs(runner, [1, 2, 4], [])
    states = [runner._requests[s] for s in (1, 2, 3)]
    from pagedserve.executor.runner import _Scheduled

    scheduled = [_Scheduled(st, 1) for st in states]
    batch = runner._host_batch(scheduled)
    assert batch.decode_only
    assert graphs._plan(batch) == (4, False)
    pool_before = runner.kv_cache.device_pool.clone()
    logits, sample_rows = graphs.run_uncaptured(batch)
    padded = logits.clone()
    assert sample_rows.tolist() == [st.slot for st in states]
    # Only the blocks holding each sequence's newest position changed: the padding row wrote nothing.
    bs = runner.block_size
    expected = {int(runner.slots.table_host[0, st.slot, st.num_computed // bs]) for st in states}
    assert 0 not in expected  # so a stray write of the padding row (to block 0) would show
    assert _written_blocks(runner, pool_before) == expected
    runner.kv_cache.device_pool.copy_(pool_before)
    from pagedserve.executor.step_inputs import stage_batch

    inputs = stage_batch(batch, runner.slots)
    eager = runner.model(inputs.input_ids, inputs.meta, runner.kv_cache.layer_caches(), None)
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("attention", "mixed_sizes", "num_pad_seqs"),
    [("reference", [32, 40], 1), ("triton", [32, 40], 1), ("reference", [300, 600], 2)],
)
def test_steps_through_padded_graph_layouts_match_hf(
    runner, hf_model, monkeypatch, attention, mixed_sizes, num_pad_seqs
):
    """Every step computed the way its CUDA graph would (padded static inputs, no capture, CPU):
    mixed prefill+decode batches padded to a mixed graph's token count, their padding tokens
    forming extra sequences of at most a block table row (256 tokens here: [300, 600] needs two),
    and decode batches padded to 4 sequences. Greedy tokens still equal Hugging Face's, and the
    padding writes no KV. With "triton" the Triton kernels run under the interpreter."""
    if attention == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", attention)
    runner.reset()
    graphs = _graphs(runner, [1, 2, 4], mixed_sizes)
    assert graphs.num_pad_seqs == num_pad_seqs
    assert graphs.num_seq_slots == 8 + num_pad_seqs
    monkeypatch.setattr(graphs, "run", graphs.run_uncaptured)
    monkeypatch.setattr(runner, "graphs", graphs)
    # Step 1: prompts 1 and 2 (37 tokens); step 2: their decodes and prompt 3 (7 tokens); then
    # decode steps of 3 sequences padded to 4.
    prompts = {1: _prompt(21, seed=1), 2: _prompt(16, seed=2), 3: _prompt(5, seed=3)}
    sched = AheadScheduler(NUM_BLOCKS, runner.block_size, max_num_batched_tokens=40)
    sched.free.remove(0)  # block 0 stays unallocated: a stray padding write would show there
    for seq_id, prompt in prompts.items():
        sched.add(seq_id, prompt)
    block0 = runner.kv_cache.device_pool[:, :, 0].clone()
    steps = 12 if attention == "reference" else 5
    steps_before = runner.stats.graph_steps
    drive_ahead(runner, sched, steps=steps)
    assert runner.stats.graph_steps - steps_before == steps
    assert torch.equal(runner.kv_cache.device_pool[:, :, 0], block0)
    for seq_id, prompt in prompts.items():
        got = sched.outputs[seq_id]
        assert len(got) >= steps - 2, seq_id
        assert got == _hf_greedy(hf_model, prompt, len(got)), seq_id


# ---- the overlapped service loop, with a runner whose steps finish when the test says -------------


class _Event:
    device = None  # (as an unrecorded CUDA event's: the service's step watcher makes none current)

    def __init__(self) -> None:
        self.fired = threading.Event()

    def query(self) -> bool:
        return self.fired.is_set()

    def synchronize(self) -> None:
        assert self.fired.wait(10), "step never finished"


class _FakeRunner:
    """Records launch/finish order; each step 'runs on the GPU' until its event fires."""

    def __init__(self, auto_finish_after: float | None = None) -> None:
        self.calls: list[str] = []
        self.ahead_of: list[int] = []  # the steps `launch_ahead` was called after
        self.events: dict[int, _Event] = {}
        self.stats = RunnerStats()
        self.num_requests = 0
        self._auto = auto_finish_after

    def launch(self, plan):
        self.calls.append(f"launch {plan.step_id}")
        event = self.events[plan.step_id] = _Event()
        if self._auto is not None:
            threading.Timer(self._auto, event.fired.set).start()
        return PendingStep(plan.step_id, time.perf_counter(), done=event)

    def finish(self, pending):
        self.calls.append(f"finish {pending.step_id}")
        return executor_pb2.StepOutput(step_id=pending.step_id)

    def launch_ahead(self, finished) -> None:
        """The real runner may launch a verification step ahead; these steps verify nothing."""
        self.ahead_of.append(finished.step_id)

    def reset(self) -> None:
        """A lease ended: the real runner forgets its requests; this one holds none."""


class _Context:
    """A Step call's context carrying the lease epoch of `_service`'s Attach."""

    def __init__(self, service: ExecutorService) -> None:
        self._epoch = service.epoch

    def invocation_metadata(self):
        return wire.lease_metadata(self._epoch)

    def abort(self, code, details):
        raise grpc.RpcError(code, details)


_SERVICES: list[ExecutorService] = []


@pytest.fixture(autouse=True)
def _close_services():
    """Stops each test's services' lease-expiry threads (else one fires in a later test)."""
    yield
    while _SERVICES:
        _SERVICES.pop().close()


def _service(runner) -> ExecutorService:
    """The service with a live lease (a scheduler attached), as a Step stream needs."""
    service = ExecutorService(runner, "fake")
    service.lease.attach("test-scheduler", "ipv4:127.0.0.1:1")
    _SERVICES.append(service)
    return service


def test_service_launches_next_plan_before_finishing_the_running_step():
    runner = _FakeRunner()
    service = _service(runner)
    plans: queue.Queue = queue.Queue()
    outputs = service.Step(iter(plans.get, None), _Context(service))
    plans.put(executor_pb2.StepPlan(step_id=1))
    plans.put(executor_pb2.StepPlan(step_id=2))
    time.sleep(0.05)  # both queued while step 1 still runs
    got = []
    consumer = threading.Thread(target=lambda: got.extend(o.step_id for o in outputs))
    consumer.start()
    time.sleep(0.05)
    runner.events[1].fired.set()
    time.sleep(0.05)
    assert runner.calls == ["launch 1", "launch 2", "finish 1"]
    runner.events[2].fired.set()
    plans.put(None)
    consumer.join(5)
    assert not consumer.is_alive(), "the stream did not end with its plans"
    assert got == [1, 2]
    assert runner.calls == ["launch 1", "launch 2", "finish 1", "finish 2"]


def test_service_launches_ahead_before_it_sends_the_output():
    """With no plan queued, the step the next plan most likely is starts before the output goes
    out: sending holds the stream's thread until the write is done."""
    runner = _FakeRunner(auto_finish_after=0.01)
    service = _service(runner)
    plans: queue.Queue = queue.Queue()
    plans.put(executor_pb2.StepPlan(step_id=1))
    outputs = service.Step(iter(plans.get, None), _Context(service))
    assert next(outputs).step_id == 1
    assert runner.calls == ["launch 1", "finish 1"] and runner.ahead_of == [1]
    plans.put(None)
    assert list(outputs) == []


def test_service_sends_a_step_done_at_its_plan_without_the_watcher():
    """A step whose device work is done when its plan has been handled (as a step launched ahead
    often is) goes out at once: no watcher thread waits for it."""
    runner = _FakeRunner()
    launch = runner.launch

    def done_at_once(plan):
        pending = launch(plan)
        pending.done.fired.set()
        return pending

    runner.launch = done_at_once
    watchers = lambda: {t for t in threading.enumerate() if t.name == "executor-step-watcher"}  # noqa: E731
    before = watchers()
    service = _service(runner)
    plans: queue.Queue = queue.Queue()
    plans.put(executor_pb2.StepPlan(step_id=1))
    outputs = service.Step(iter(plans.get, None), _Context(service))
    assert next(outputs).step_id == 1
    plans.put(None)
    assert list(outputs) == []
    assert not watchers() - before


def test_service_finishes_the_pending_step_when_the_stream_ends():
    runner = _FakeRunner(auto_finish_after=0.05)
    service = _service(runner)
    plans: queue.Queue = queue.Queue()
    plans.put(executor_pb2.StepPlan(step_id=1))
    plans.put(None)  # the client closes its side right after its last plan
    outputs = service.Step(iter(plans.get, None), _Context(service))
    assert [o.step_id for o in outputs] == [1]


def test_service_sends_output_without_waiting_for_a_plan_that_is_not_coming():
    """The engine's drain: it waits for output N before it sends anything more."""
    runner = _FakeRunner(auto_finish_after=0.02)
    service = _service(runner)
    plans: queue.Queue = queue.Queue()
    outputs = service.Step(iter(plans.get, None), _Context(service))
    for step_id in (1, 2, 3):
        plans.put(executor_pb2.StepPlan(step_id=step_id))
        assert next(outputs).step_id == step_id  # would hang if the loop waited for step_id + 1
    plans.put(None)
    assert list(outputs) == []


def test_service_sends_pending_output_before_a_bad_plan_aborts():
    class Failing(_FakeRunner):
        def launch(self, plan):
            if plan.step_id == 2:
                from pagedserve.executor.runner import PlanError

                raise PlanError("bad")
            return super().launch(plan)

    runner = Failing(auto_finish_after=0.01)
    service = _service(runner)
    plans: queue.Queue = queue.Queue()
    plans.put(executor_pb2.StepPlan(step_id=1))
    plans.put(executor_pb2.StepPlan(step_id=2))
    time.sleep(0.01)
    outputs = service.Step(iter(plans.get, None), _Context(service))
    assert next(outputs).step_id == 1
    with pytest.raises(grpc.RpcError):
        next(outputs)


def test_packed_inputs_start_16_byte_aligned():
    """Kernels receive views into one packed buffer; Triton compiles a variant per pointer
    alignment, so every view starts 16-byte aligned whatever the lengths before it."""
    arrays = [np.arange(n, dtype=np.int64) for n in (3, 1, 4, 0, 5)]
    host, offsets = pack_int64(arrays, torch.device("cpu"))
    assert all(offset % 2 == 0 for offset in offsets)
    for array, offset in zip(arrays, offsets, strict=True):
        assert host[offset : offset + len(array)].tolist() == array.tolist()


def test_step_trace_records_each_step_and_sums_up(tiny_model_dir, tmp_path):
    """--step-trace writes one line per step with its shape; the summary groups them by kind."""
    from pagedserve.executor.step_trace import load, summarize

    path = tmp_path / "trace.jsonl"
    config = ExecutorConfig(
        model=str(tiny_model_dir), device="cpu", num_gpu_blocks_override=NUM_BLOCKS, swap_space=0,
        max_model_len=256, max_num_seqs=8, step_trace=str(path),
    )  # fmt: skip
    traced = ModelRunner.create(config)
    sched = AheadScheduler(NUM_BLOCKS, traced.block_size, max_num_batched_tokens=24)
    sched.add(1, _prompt(20, seed=1))
    sched.add(2, _prompt(9, seed=2))
    drive_ahead(traced, sched, steps=6)
    traced.tracer.close()
    records = load(path)
    assert [r["step_id"] for r in records] == list(range(1, 7))
    # Step 1: prompt 1 (prompt 2 does not fit the budget of 24 beside it); step 2: prompt 2 beside
    # seq 1's first decode; then decodes of both.
    shapes = [(r["tokens"], r["seqs"], r["decodes"]) for r in records]
    assert shapes[:3] == [(20, 1, 0), (10, 2, 1), (2, 2, 2)]
    assert records[2]["kv_tokens"] == 22 + 10
    assert all(r["gpu_ms"] is None and r["launch_ms"] > 0 for r in records)  # no CUDA events here
    text = summarize(records)
    assert "| prefill | 1 | 20 | 0 |" in text
    assert "| mixed | 1 | 10 | 1 |" in text
    assert "| decode | 4 | 8 |" in text
    assert all(r["copied_beside"] == r["swapped"] == 0 for r in records)
    assert "host copies" not in text  # (no table of copies where there were none)
    # Host timestamps: each launch on its plan, each output after its launch, in step order.
    assert all(r["plan_at_ms"] == r["launched_at_ms"] < r["output_at_ms"] for r in records)
    assert all(a["launched_at_ms"] < b["launched_at_ms"] for a, b in zip(records, records[1:], strict=False))
    assert "| launched on its plan | 5 |" in text  # (the round trip from each step before)


def test_step_trace_summary_separates_steps_around_tier_copies():
    """A step with tier copies beside its forward and the step after it (which waits for them) are
    summed apart from the others, so a trace shows what the copies cost."""
    from pagedserve.executor.step_trace import summarize

    def decode(step_id, copied_beside=0, swapped=0, gap_ms=0.0):
        return {
            "step_id": step_id, "tokens": 4, "seqs": 4, "decodes": 4, "kv_tokens": 400,
            "copied_beside": copied_beside, "swapped": swapped, "graph": True, "launch_ms": 0.1,
            "gpu_ms": 7.0, "gap_ms": gap_ms,
        }  # fmt: skip

    text = summarize([decode(1), decode(2, copied_beside=100), decode(3, gap_ms=2.0), decode(4, swapped=3)])
    assert "| decode | 4 | 16 | 16 |" in text  # by kind: all four
    assert "| decode, copies beside | 1 | 4 | 4 |" in text
    assert "| decode, waits for copies | 1 | 4 | 4 | 100 | 0.01 | 0.00 |" in text
    assert "| decode, swaps | 1 | 4 | 4 |" in text
