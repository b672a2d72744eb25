"""`pagedserve bench` at small batches: passes at several --max-concurrency limits in one run, and
the weight + KV read floor per step beside the per-token latencies (from what the executors
report on attach: `Admin.ListExecutors`); the executor's side of those figures."""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from pagedserve import bench
from pagedserve.bench import PassResult, RequestRecord, cli
from pagedserve.bench.client import ReadFloorInputs
from pagedserve.bench.metrics import read_floor
from pagedserve.protos import admin_pb2, admin_pb2_grpc, generation_pb2_grpc
from tests.test_bench import FakeServer


def _record(index: int, prompt: int, first: float, last: float, tokens: int) -> RequestRecord:
    record = RequestRecord(index, prompt, tokens, start=first - 0.1, end=last)
    step = (last - first) / (tokens - 1)
    record.message_times = [first + i * step for i in range(tokens)]
    record.message_tokens = [1] * tokens
    record.token_ids = list(range(tokens))
    return record


def test_read_floor_counts_weights_once_and_the_decoding_contexts():
    """Two requests decoding over the same second: batch 2, context prompt + output / 2."""
    records = [_record(0, 100, 1.0, 2.0, 11), _record(1, 300, 1.0, 2.0, 11)]
    inputs = ReadFloorInputs(weight_read_bytes=8_000_000, kv_bytes_per_token=1000, copy_bytes_per_s=1e9)
    floor = read_floor(records, inputs)
    assert floor["decode_batch"] == pytest.approx(2.0)
    assert floor["mean_context_tokens"] == pytest.approx(205.5)  # (105.5 + 305.5) / 2
    assert floor["kv_read_bytes"] == pytest.approx(2 * 205.5 * 1000)
    assert floor["floor_ms"] == pytest.approx(1000 * (8_000_000 + 411_000) / 1e9)
    # one after the other: batch 1; two executors share a batch
    serial = [_record(0, 100, 1.0, 2.0, 11), _record(1, 100, 2.0, 3.0, 11)]
    assert read_floor(serial, inputs)["decode_batch"] == pytest.approx(1.0)
    two = ReadFloorInputs(8_000_000, 1000, 1e9, num_executors=2)
    assert read_floor(records, two)["decode_batch"] == pytest.approx(1.0)
    assert read_floor(records, ReadFloorInputs(1, 1, 0.0)) is None  # off CUDA: no bandwidth
    assert read_floor(records, None) is None


def test_summary_and_table_put_the_floor_beside_itl():
    records = [_record(0, 100, 1.0, 2.0, 11)]
    result = PassResult("rate inf", float("inf"), records, 0.0, 2.0, None, None, max_concurrency=1)
    result.floor_inputs = ReadFloorInputs(50_000_000, 1000, 1e9)
    run = bench.summarize(result)
    floor = run["read_floor"]
    assert run["max_concurrency"] == 1
    assert floor["itl_p50_over_floor"] == pytest.approx(100.0 / floor["floor_ms"])
    table = bench.results_table([run])
    for row in ("max concurrency", "read floor per step (ms)", "ITL p50 / floor", "weight + KV read"):
        assert row in table
    plain = bench.results_table([bench.summarize(PassResult("x", 1.0, records, 0.0, 2.0, None, None))])
    assert "read floor" not in plain and "max concurrency" not in plain


class FloorServer(FakeServer):
    """The fake scheduler with one attached executor reporting its floor inputs, counting how many
    requests are in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.peak: list[int] = []
        self._lock = threading.Lock()

    def Generate(self, request, context):
        with self._lock:
            self.in_flight += 1
            self.peak[-1] = max(self.peak[-1], self.in_flight)
        try:
            time.sleep(0.01)
            yield from super().Generate(request, context)
        finally:
            with self._lock:
                self.in_flight -= 1

    def ListExecutors(self, request, context):
        status = admin_pb2.ExecutorStatus(
            address="x", attached=True, weight_read_bytes=16_000_000_000, kv_bytes_per_token=131072,
            copy_bytes_per_s=4.28e12,
        )  # fmt: skip
        return admin_pb2.ListExecutorsResponse(executors=[status])


def test_one_run_at_three_concurrencies(tmp_path, capsys, monkeypatch):
    server = grpc.server(futures.ThreadPoolExecutor(16))
    fake = FloorServer()
    generation_pb2_grpc.add_GenerationServicer_to_server(fake, server)
    admin_pb2_grpc.add_AdminServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    result = tmp_path / "latency.json"
    argv = ["--port", str(port), "--num-prompts", "6", "--input-len", "5", "--output-len", "5"]
    argv += ["--max-concurrency", "1,2,4", "--result-file", str(result), "--no-plot"]
    passes_seen = []
    original = cli.run_pass

    def run_pass(*args, **kwargs):  # a fresh peak per pass
        fake.peak.append(0)
        passes_seen.append(args[3].max_concurrency)
        return original(*args, **kwargs)

    monkeypatch.setattr(cli, "run_pass", run_pass)
    try:
        assert bench.main(argv) == 0
    finally:
        server.stop(None)
    runs = json.loads(result.read_text())["runs"]
    assert [r["label"] for r in runs] == [f"rate inf, concurrency {c}" for c in (1, 2, 4)]
    assert [r["max_concurrency"] for r in runs] == passes_seen == [1, 2, 4]
    assert [r["seed"] for r in runs] == [1, 2, 3]  # fresh prompts per pass
    assert fake.peak[0] == 1 and max(fake.peak) <= 4
    for run in runs:
        assert run["read_floor"]["weight_read_bytes"] == 16_000_000_000
        assert run["read_floor"]["floor_ms"] > 16_000_000_000 / 4.28e12 * 1000
    out = capsys.readouterr().out
    assert "ITL p50 / floor" in out and "concurrency 4" in out


@pytest.mark.parametrize(
    "extra", [["--in-process", "--model", "x"], ["--compare-prefix-caching", "--launch"]]
)
def test_a_list_of_limits_is_for_grpc_passes(extra):
    with pytest.raises(SystemExit, match="list of --max-concurrency"):
        bench.main(["--max-concurrency", "1,8", "--model", "m", *extra])


def test_bad_concurrency_lists_are_argparse_errors(capsys):
    for bad in ("0", "1,0", "1,x", ","):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(["--max-concurrency", bad])
        assert "--max-concurrency" in capsys.readouterr().err
    assert bench.build_parser().parse_args(["--max-concurrency", "8"]).max_concurrency == [8]


def test_executor_reports_its_read_floor_inputs(tiny_model_dir):
    """What the executor tells the scheduler on attach: weights as loaded (FP8 linears one byte
    per element; the separate LM head counted, the embedding table not) and a token's KV bytes;
    no copy bandwidth off CUDA."""
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.runner import ModelRunner
    from pagedserve.executor.service import attach_response

    model_dir = tiny_model_dir  # its LM head is separate from the embeddings
    runner = ModelRunner.create(
        ExecutorConfig(model=str(model_dir), device="cpu", num_gpu_blocks_override=8, max_model_len=128)
    )
    model, spec = runner.model, runner.spec
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.embed_tokens.weight
    assert runner.weight_read_bytes == every - embedding.numel() * embedding.element_size()
    element = torch.empty((), dtype=runner.kv_cache.layout.dtype).element_size()
    assert runner.kv_bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element
    assert runner.copy_bytes_per_s == 0.0 and runner.host_copy_bytes_per_s == 0.0
    reply = attach_response(runner, "tiny", 1, 10.0)
    assert (reply.weight_read_bytes, reply.kv_bytes_per_token) == (
        runner.weight_read_bytes,
        runner.kv_bytes_per_token,
    )
