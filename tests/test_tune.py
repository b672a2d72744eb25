"""`pagedserve tune`: the grid, the choice and its reasons on synthetic results, bad flags, and the
whole loop on the CPU: a scheduler's --request-log from a launched bench run, replayed by `tune`
over two points, whose own request logs show the same lengths and the same prefix sharing."""

from __future__ import annotations

import json

import pytest

from pagedserve import tune
from pagedserve.bench.replay import sharing_signature
from pagedserve.bench.tuning import PointResult, _judge, recommend
from pagedserve.common.request_log import read_request_log
from pagedserve.tune import GridPoint


def parse(argv: list[str]):
    return tune.build_parser().parse_args(argv)


def test_the_grid_is_every_combination_and_one_utilization_on_the_cpu():
    args = parse(["--workload", "W1", "--max-num-seqs", "64,128", "--enable-prefix-caching", "on,off"])
    points = tune.grid_points(args, on_cpu=False)
    assert len(points) == 2 * 4 * 2
    assert {p.gpu_memory_utilization for p in points} == {0.85, 0.88, 0.90, 0.92}
    # Points sharing executors are next to each other (one launch each), caching on first.
    keys = [p.executor_key() for p in points]
    assert len(keys) == 16 and all(keys[i] == keys[i + 1] for i in range(0, 16, 2))
    assert [p.enable_prefix_caching for p in points[:2]] == [True, False]
    assert len(tune.grid_points(args, on_cpu=True)) == 2 * 2
    point = GridPoint(0.9, False, max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_dtype="fp8")
    assert point.executor_flags() == [
        "--gpu-memory-utilization", "0.9", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
        "--kv-cache-dtype", "fp8",
    ]  # fmt: skip
    assert point.scheduler_flags() == ["--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
                                       "--no-enable-prefix-caching"]  # fmt: skip


def result(index, point, tok_s, ttft_p99, itl_p99=10.0, preemptions=0, hit=None, peak=500, computed=1000):
    summary = {
        "output_throughput": tok_s,
        "ttft_ms": {"p50": ttft_p99 / 2, "p99": ttft_p99},
        "itl_ms": {"p50": itl_p99 / 2, "p99": itl_p99},
        "failed": 0,
        "num_requests": 100,
        "server": {
            "preemptions": preemptions,
            "prefix_cache_hit_rate": hit,
            "peak_gpu_blocks_in_use": peak,
            "num_gpu_blocks": 1000,
            "prompt_tokens_computed": computed,
        },
    }
    return PointResult(index, point, summary=summary, goodput=tok_s / 100)


def judged(results, ttft=None, itl=None):
    for r in results:
        _judge(r, ttft, itl)
    return results


def test_the_choice_meets_the_slos_and_says_why_in_the_seeds_terms():
    results = judged(
        [
            result(
                0, GridPoint(0.9, True, max_num_seqs=256), 2000.0, 900.0, preemptions=40, hit=0.5, peak=1000
            ),
            result(1, GridPoint(0.9, True, max_num_seqs=128), 1500.0, 300.0, hit=0.5),
            result(2, GridPoint(0.9, False, max_num_seqs=128), 1300.0, 400.0, computed=2000),
        ],
        ttft=500.0,
    )
    choice = recommend(results, "throughput", 500.0, None)
    assert choice["index"] == 1  # the fastest point breaks the TTFT bound
    text = " ".join(choice["reasons"])
    assert "2 met p99 TTFT <= 500 ms" in text
    assert "40.0 at seqs 256" in text and "lower --max-num-seqs" in text  # pre-emptions
    assert "hit rate 50.0%, 50% fewer prompt tokens computed" in text  # caching on vs off
    assert "memory headroom: peak KV use 50.0%" in text
    assert choice["scheduler_flags"][-1] == "--enable-prefix-caching"

    goodput = recommend(results, "goodput", 500.0, None)  # requests/s within the SLOs, as measured
    assert goodput["index"] == 0


def test_ties_go_to_the_lower_p99_ttft_and_infeasible_grids_say_so():
    tied = judged(
        [result(0, GridPoint(0.85, True), 1000.0, 90.0), result(1, GridPoint(0.92, True), 1010.0, 120.0)]
    )
    choice = recommend(tied, "throughput", None, None)
    assert choice["index"] == 0 and "2 points within 3% of the best" in " ".join(choice["reasons"])
    slow = judged(
        [result(0, GridPoint(0.85, True), 1000.0, 900.0), result(1, GridPoint(0.9, True), 900.0, 700.0)],
        ttft=100.0,
    )
    choice = recommend(slow, "throughput", 100.0, None)
    assert choice["index"] == 1 and "no point met the SLOs" in " ".join(choice["reasons"])
    failed = [PointResult(0, GridPoint(0.9, True), error="executor exited with 1")]
    assert recommend(judged(failed), "throughput", None, None)["index"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give the traffic to replay"),
        (["--workload", "W1", "--traffic", "x.jsonl"], "give the traffic to replay"),
        (["--workload", "W3"], "--workload W3 needs --request-rate"),
        (["--workload", "W1", "--time-scale", "0.5"], "--time-scale compresses a --traffic log"),
        (["--workload", "W1", "--objective", "goodput"], "--objective goodput counts requests"),
        (["--workload", "W1", "--max-num-seqs", "0,8"], "argument --max-num-seqs: expected comma-separated"),
        (["--workload", "W1", "--enable-prefix-caching", "yes"], "argument --enable-prefix-caching"),
        (["--workload", "W1", "--gpu-memory-utilization", "0.9,1.5"], "argument --gpu-memory-utilization"),
        (
            ["--workload", "W1", "--executor-args", "--block-size 17"],
            "--block-size must be a positive multiple",
        ),
        (["--workload", "W1", "--max-num-seqs", "512", "--max-num-batched-tokens", "256"], "must be >="),
    ],
)
def test_bad_flags_fail_with_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        tune.main(["--executor-args", "--device cpu", *argv] if "--executor-args" not in argv else argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert sum(": error:" in line for line in err.splitlines()) == 1


def test_a_malformed_log_fails_before_any_launch(tmp_path, capsys):
    log = tmp_path / "requests.jsonl"
    log.write_text('{"v": 1, "request_id": "a"}\nnot json\n')
    with pytest.raises(SystemExit) as exc:
        tune.main(["--traffic", str(log)])
    assert exc.value.code == 2
    assert f"pagedserve tune: error: {log}:1: missing arrival_time" in capsys.readouterr().err


def test_serve_forwards_the_request_log_to_its_scheduler(tmp_path):
    from pagedserve import cli

    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--request-log", str(tmp_path / "r.jsonl"), "--request-log-text"])
    (scheduler,) = [c for c in cli.serve_children(args, tmp_path) if c.name == "scheduler"]
    argv = scheduler.argv
    assert argv[argv.index("--request-log") + 1] == str(tmp_path / "r.jsonl") and "--request-log-text" in argv


@pytest.mark.slow
def test_a_request_log_round_trips_through_tune(tiny_model_dir, tmp_path, capsys):
    """bench --launch writes a log of shared-prefix traffic; tune replays it with prefix caching on
    and off (one executor launch, two schedulers): each point's own log has the original's lengths
    and prefix sharing, and the run ends in a recommendation, its JSON and its plot."""
    from pagedserve import bench

    source = tmp_path / "source.jsonl"
    executor_args = "--device cpu --dtype float32 --max-num-seqs 8"
    assert bench.main([
        "--launch", "--model", str(tiny_model_dir), "--executor-args", executor_args,
        "--scheduler-args", f"--max-num-seqs 8 --request-log {source} --request-log-text",
        "--dataset", "shared-prefix",
        "--num-prompts", "12", "--prefix-len", "48", "--num-prefixes", "3", "--input-len", "8:40",
        "--output-len", "4:12", "--request-rate", "40", "--result-file", str(tmp_path / "bench.json"),
        "--no-plot",
    ]) == 0  # fmt: skip
    original = read_request_log(source)
    assert len(original) == 12 and all(r.finish_reason == "length" for r in original)
    assert sum(r.cached_prompt_tokens for r in original) > 0  # the prefixes were shared
    assert all(r.prompt_text and r.output_text is not None for r in original)  # --request-log-text

    result_file = tmp_path / "tune" / "tune.json"
    status = tune.main([
        "--model", str(tiny_model_dir), "--traffic", str(source), "--executor-args", executor_args,
        "--max-num-seqs", "8", "--enable-prefix-caching", "on,off", "--num-warmups", "1", "--time-scale", "0",
        "--slo-ttft-p99", "60000", "--result-file", str(result_file),
    ])  # fmt: skip
    assert status == 0
    out = capsys.readouterr().out
    assert "recommended: seqs 8, util 0.85, caching" in out and "pre-emptions:" in out
    report = json.loads(result_file.read_text())
    assert report["recommendation"]["index"] in (0, 1)
    assert result_file.with_suffix(".png").stat().st_size > 0
    assert [p["label"] for p in report["points"]] == [
        "seqs 8, util 0.85, caching on",
        "seqs 8, util 0.85, caching off",
    ]
    for k, point in enumerate(report["points"]):
        assert point["error"] is None and point["summary"]["failed"] == 0
        assert point["replay_fidelity"]["prompt_lengths_equal"] and point["replay_fidelity"]["sharing_equal"]
        # The point's own log, read here: the same lengths and sharing as the original, by index.
        replayed = [r for r in read_request_log(result_file.parent / "logs" / f"point-{k}" / "requests.jsonl")
                    if not r.request_id.startswith("bench-warmup")]  # fmt: skip
        replayed.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
        assert [(r.prompt_len, r.output_len) for r in replayed] == [
            (r.prompt_len, r.output_len) for r in original
        ]
        assert sharing_signature([r.block_hashes for r in replayed]) == sharing_signature(
            [r.block_hashes for r in original]
        )
    on, off = (p["summary"]["server"] for p in report["points"])
    assert on["prefix_cache_hit_rate"] > 0 and off["prefix_cache_hit_rate"] is None
