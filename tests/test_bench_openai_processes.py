"""The gateway passes of `pagedserve bench` with several client processes (issue 15's measurement):
the requests dealt out to spawned processes, each with its own `openai` client, started at one
instant, their records merged into one pass that the metrics read as they read any other. On the
CPU (float32) every greedy output through the gateway equals the gRPC service's, request by request.
"""

from __future__ import annotations

import math

import pytest

from pagedserve.bench.cli import mark_matches, openai_comparison
from pagedserve.bench.client import PassResult, RequestRecord, SendOptions, get_model_info, run_pass
from pagedserve.bench.launch import free_port, launched_server
from pagedserve.bench.metrics import first_difference, output_matches, summarize
from pagedserve.bench.openai_client import launched_gateway, run_openai_pass
from pagedserve.bench.workloads import LengthRange, Workload, generate_requests

CPU = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "128", "--swap-space", "0.01"]
GREEDY = SendOptions(temperature=0.0, ignore_eos=True)


def _requests(vocab_size: int, num: int = 8):
    workload = Workload("random", num, LengthRange(8, 40), LengthRange(4, 12), seed=3)
    return generate_requests(workload, vocab_size)


def _check_merged(result: PassResult, requests, streamed: bool) -> None:
    """One record per request, in request order, each complete and timed from the common start."""
    assert [r.index for r in result.records] == [q.index for q in requests]
    for record, request in zip(result.records, requests, strict=True):
        assert record.ok, record.error
        assert record.num_output == request.output_len  # ignore_eos: every token asked for
        assert record.finish_reason == "FINISH_REASON_LENGTH"
        assert result.start <= record.start < record.message_times[0] <= record.end <= result.end
        assert record.message_times == sorted(record.message_times)
        assert sum(record.message_tokens) == record.num_output
        assert len(record.message_times) > 1 if streamed else len(record.message_times) == 1
    run = summarize(result)
    assert run["completed"] == len(requests) and run["failed"] == 0
    assert run["total_output_tokens"] == sum(q.output_len for q in requests)
    assert run["server"] is not None and run["server"]["tokens_generated"] >= run["total_output_tokens"]


@pytest.mark.slow
def test_two_client_processes_merge_into_one_pass_with_the_grpc_outputs(tiny_model_dir, tmp_path):
    no_cache = ["--no-enable-prefix-caching"]  # the same prompts go three times
    with launched_server(str(tiny_model_dir), tmp_path / "logs", CPU, no_cache) as address:
        requests = _requests(get_model_info(address).vocab_size)
        grpc_pass = run_pass(address, requests, math.inf, GREEDY, "gRPC")
        with launched_gateway(address, tmp_path / "logs") as url:
            stream = run_openai_pass(url, address, requests, math.inf, GREEDY, "stream", True, processes=2)
            plain = run_openai_pass([url], address, requests, math.inf, GREEDY, "plain", False, processes=2)
    _check_merged(stream, requests, streamed=True)
    _check_merged(plain, requests, streamed=False)
    for result in (stream, plain):  # float32: the same tokens whatever the batching, every request
        assert output_matches(grpc_pass, result) == {q.index: None for q in requests}
    comparison = openai_comparison(grpc_pass, stream, plain, greedy=True)
    assert comparison["greedy outputs identical (stream)"] and comparison["greedy outputs identical (plain)"]
    assert comparison["greedy requests identical (stream)"] == "8 / 8 (100.0%)"
    assert comparison["requests issued in (s), stream"] >= 0


def test_a_client_process_that_fails_fails_the_pass_with_its_error(tmp_path):
    """Nothing listens at the URL: the client processes' error comes back (none is left running)."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match=r"openai-client-\d failed: APIConnectionError"):
        run_openai_pass(url, None, _requests(512, 4), math.inf, GREEDY, "x", True, processes=2)


def test_greedy_matches_are_reported_request_by_request():
    def result(*outputs: list[int]) -> PassResult:
        records = [RequestRecord(i, 4, len(t), token_ids=list(t)) for i, t in enumerate(outputs)]
        return PassResult("p", math.inf, records, 0.0, 1.0, None, None)

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    a, b = result([1, 2, 3], [4, 5, 6], [7, 8]), result([1, 2, 3], [4, 9, 9], [7, 8])
    b.records[2].error = "UNAVAILABLE: gone"  # a failed request is not compared
    assert output_matches(a, b) == {0: None, 1: 1}
    run = summarize(b)
    mark_matches(run, output_matches(a, b), "grpc")
    marks = [(r.get("identical_to_grpc"), r.get("first_difference")) for r in run["requests"]]
    assert marks == [(True, None), (False, 1), (None, None)]
    comparison = openai_comparison(a, b, a, greedy=True)
    assert comparison["greedy requests identical (stream)"] == "1 / 2 (50.0%)"
    assert comparison["greedy differing (stream, index@token)"] == "1@1"
    assert comparison["greedy outputs identical (plain)"] is True


def test_client_processes_and_gateways_flags():
    from pagedserve import bench
    from pagedserve.bench.cli import build_parser

    args = build_parser().parse_args(["--compare-openai"])
    assert args.openai_client_processes is None  # resolved in main: min(8, cores), 1 with --max-concurrency
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--openai-client-processes", "0"])
    with pytest.raises(SystemExit, match="needs one client process"):
        bench.main(["--through-openai", "http://x", "--openai-client-processes", "2", "--max-concurrency=4"])
    with pytest.raises(SystemExit, match="--openai-gateways launches gateways for --compare-openai"):
        bench.main(["--openai-gateways", "2"])


@pytest.mark.slow
def test_gateway_load_measures_two_gateways_without_a_model(tmp_path, capsys):
    """`python -m benchmarks.gateway_load`: a stand-in scheduler, two gateways, one and two
    client processes; every request completes with every message, and the CPU is accounted."""
    import json

    from benchmarks import gateway_load

    result = tmp_path / "load.json"
    argv = ["--num-prompts", "6", "--input-len", "16:64", "--output-len", "9", "--step-ms", "1",
            "--client-processes", "1,2", "--gateways", "2", "--no-plain", "--log-dir", str(tmp_path),
            "--result-file", str(result)]  # fmt: skip
    assert gateway_load.main(argv) == 0
    passes = json.loads(result.read_text())["passes"]
    assert [p["pass"] for p in passes] == ["P=1 stream", "P=2 stream"]
    for p in passes:
        assert p["requests ok / sent"] == "6 / 6"
        assert p["messages (SSE chunks with tokens)"] == 6 * 3  # 1 token, then 4, then 4
        assert p["gateway CPU (s)"] >= 0 and p["client CPU (s, all processes, while sending)"] > 0
    assert "gateway CPU ms per request" in capsys.readouterr().out
