"""`pagedserve bench --in-process` and `--compare-in-process` (issue 5), on CPU with the tiny model.

The in-process pass runs the scheduler's Engine on the executor's ModelRunner through
InProcessTransport; it must produce what the gRPC services produce, token for token (greedy).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve import bench
from pagedserve.entrypoints.inprocess import InProcessTransport
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.runner import ModelRunner
from pagedserve.scheduler.completion import Delta, StopConditions
from pagedserve.scheduler.engine import Engine
from pagedserve.scheduler.request import SamplingOptions
from pagedserve.scheduler.service import load_tokenizer
from pagedserve.scheduler.service_config import ServiceConfig
from tests.services import hf_greedy

CPU = ["--executor-args", "--device cpu --dtype float32"]
SMALL = ["--num-prompts", "6", "--input-len", "8:40", "--output-len", "4:12", "--no-plot"]


async def _collect(active) -> list[int] | Exception:
    tokens: list[int] = []
    while True:
        item: Delta | Exception = await active.deltas.get()
        if isinstance(item, Exception):
            return item
        tokens += item.token_ids
        if item.finish_reason is not None:
            return tokens


def test_engine_on_in_process_transport_generates_and_survives_a_failed_step(tiny_model_dir, hf_model):
    """Greedy tokens equal Hugging Face's; a step that fails is handled as a lost executor is over
    gRPC: the engine re-attaches under a new lease and recomputes the request, whose stream goes on
    with the same tokens (no error, no duplicate)."""
    model = str(tiny_model_dir)
    runner = ModelRunner.create(ExecutorConfig(model=model, device="cpu", dtype="float32"))
    prompt = [7, 8, 9, 10, 11]
    greedy, stop = SamplingOptions(temperature=0.0), StopConditions(max_tokens=10)

    async def scenario() -> None:
        transport = InProcessTransport(runner, model)
        engine = Engine(ServiceConfig(model=model), load_tokenizer(model), lambda _address: transport)
        task = asyncio.create_task(engine.run())
        try:
            await asyncio.wait_for(engine.wait_until_attached(), 30)
            tokens = await asyncio.wait_for(_collect(engine.submit("a", prompt, greedy, stop)), 30)
            assert tokens == hf_greedy(hf_model, prompt, 10)
            launch, launched = runner.launch, []

            def fails_on_the_fifth_step(plan):
                launched.append(plan.step_id)
                if len(launched) == 5:
                    del runner.launch  # the next lease's steps run again
                    raise ValueError("boom")
                return launch(plan)

            runner.launch = fails_on_the_fifth_step  # an instance attribute shadows the method
            tokens = await asyncio.wait_for(_collect(engine.submit("b", prompt, greedy, stop)), 30)
            assert tokens == hf_greedy(hf_model, prompt, 10)
            assert transport.epoch == 2  # re-attached under a new lease
            (status,) = engine.executor_statuses()
            assert status.requests_routed == 3  # a, b, and b again
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())


def test_stream_interval_batches_tokens_but_not_the_first_or_last(tiny_model_dir, hf_model):
    """--stream-interval 3: the first token alone (time to first token), then messages of 3, and
    whatever is left with the finish reason; the tokens and text are those of interval 1."""
    model = str(tiny_model_dir)
    runner = ModelRunner.create(ExecutorConfig(model=model, device="cpu", dtype="float32"))
    prompt = [7, 8, 9, 10, 11]
    greedy, stop = SamplingOptions(temperature=0.0), StopConditions(max_tokens=9)

    async def messages(interval: int) -> list[Delta]:
        config = ServiceConfig(model=model, stream_interval=interval)
        transport = InProcessTransport(runner, model)
        engine = Engine(config, load_tokenizer(model), lambda _address: transport)
        task = asyncio.create_task(engine.run())
        try:
            await asyncio.wait_for(engine.wait_until_attached(), 30)
            active = engine.submit("a", prompt, greedy, stop)
            got: list[Delta] = []
            while not got or got[-1].finish_reason is None:
                got.append(await asyncio.wait_for(active.deltas.get(), 30))
            return got
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    each, batched = asyncio.run(messages(1)), asyncio.run(messages(3))
    assert [len(d.token_ids) for d in each] == [1] * 9
    assert [len(d.token_ids) for d in batched] == [1, 3, 3, 2]
    assert [t for d in batched for t in d.token_ids] == hf_greedy(hf_model, prompt, 9)
    assert "".join(d.text for d in batched) == "".join(d.text for d in each)
    with pytest.raises(ValueError, match="stream_interval"):
        ServiceConfig(model=model, stream_interval=0)


def test_in_process_pass_completes_its_requests(tiny_model_dir, tmp_path):
    result = tmp_path / "local.json"
    argv = ["--in-process", "--model", str(tiny_model_dir), "--executor-args", "--device cpu"]
    argv += [*SMALL, "--num-warmups", "2", "--result-file", str(result)]
    assert bench.main(argv) == 0
    (run,) = json.loads(result.read_text())["runs"]
    assert (run["label"], run["completed"], run["failed"]) == ("in-process", 6, 0)
    assert all(r["output_tokens"] == r["max_tokens"] for r in run["requests"])  # EOS ignored
    assert run["server"]["prompt_tokens_computed"] == run["total_input_tokens"]
    assert run["tpot_ms"]["mean"] is not None  # tokens were streamed, not delivered in one piece


def test_in_process_flags_are_checked_before_anything_runs(tiny_model_dir):
    with pytest.raises(SystemExit):
        bench.main(["--in-process"])  # no --model
    with pytest.raises(SystemExit):
        bench.main(["--compare-in-process", "--model", str(tiny_model_dir)])  # no --launch
    with pytest.raises(SystemExit):  # the executor's own parser rejects the flag
        bench.main(["--in-process", "--model", str(tiny_model_dir), "--executor-args", "--device tpu"])


@pytest.mark.slow
def test_compare_in_process_matches_the_grpc_services(tiny_model_dir, tmp_path, capsys):
    """Same flags for both passes; with --step-trace each pass keeps a trace of its own."""
    result, trace = tmp_path / "split.json", tmp_path / "trace.jsonl"
    argv = ["--launch", "--compare-in-process", "--model", str(tiny_model_dir)]
    argv += ["--executor-args", f"--device cpu --dtype float32 --step-trace {trace}"]
    argv += [*SMALL, "--result-file", str(result)]
    assert bench.main(argv) == 0
    for path in (trace, tmp_path / "trace-in-process.jsonl"):
        lines = path.read_text().splitlines()
        assert sum(json.loads(line)["tokens"] for line in lines) > 6 * 8, path
    report = json.loads(result.read_text())
    grpc_run, local_run = report["runs"]
    assert (grpc_run["label"], local_run["label"]) == ("gRPC", "in-process")
    assert grpc_run["completed"] == local_run["completed"] == 6
    comparison = report["comparison"]
    assert comparison["greedy outputs identical"] is True
    assert comparison["requests compared"] == 6
    ratio = grpc_run["output_throughput"] / local_run["output_throughput"]
    assert comparison["output throughput ratio gRPC/in-process"] == pytest.approx(ratio)
    assert comparison["service split cost (1 - gRPC/in-process)"] == pytest.approx(1 - ratio)
    assert "gRPC services vs in-process" in capsys.readouterr().out
