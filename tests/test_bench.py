"""`pagedserve bench` and `pagedserve make-model`.

Workload generation, metrics and the report are checked on synthetic records; the gRPC client
against a small in-process fake server (streaming, a failing request, Admin.GetStats); then the
whole command against launched tiny-model services on CPU. No timing assertions anywhere.
"""

from __future__ import annotations

import json
import math
import random
from concurrent import futures

import grpc
import pytest

from pagedserve import bench
from pagedserve.bench import BenchRequest, LengthRange, PassResult, RequestRecord, Workload
from pagedserve.bench import client as bench_client
from pagedserve.model_shapes import SHAPES, ModelShape, write_shape_model
from pagedserve.protos import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.services import free_port

# ---------------------------------------------------------------------------------------------
# Workloads


def test_length_range_parses_fixed_and_uniform():
    assert LengthRange.parse("64") == LengthRange(64, 64)
    assert LengthRange.parse("128:1024") == LengthRange(128, 1024)
    assert str(LengthRange(8, 40)) == "8:40"
    for bad in ("9:3", "1:", ":5", "1:2:3", "abc"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


def test_w1_is_drawn_as_workloads_md_says():
    """random.Random(1); per request the prompt (length, then ids in [1000, 100000)), then output length."""
    args = bench.build_parser().parse_args(["--workload", "W1"])
    workload, rates = bench.resolve(args)
    assert rates == [math.inf]
    requests = bench.generate_requests(workload, vocab_size=128256, max_model_len=8192)
    assert len(requests) == 512

    rng = random.Random(1)
    for req in requests:
        n = rng.randint(128, 1024)
        prompt = [rng.randrange(1000, 100000) for _ in range(n)]
        assert req.prompt == tuple(prompt)
        assert req.output_len == rng.randint(64, 512)


def test_w2_shares_one_prefix_and_w3_sends_w1s_prompts():
    w2, _ = bench.resolve(bench.build_parser().parse_args(["--workload", "W2"]))
    requests = bench.generate_requests(w2, vocab_size=128256, max_model_len=8192)
    assert len(requests) == 256
    prefix = requests[0].prompt[:1024]
    assert all(len(r.prompt) == 1024 + 64 and r.prompt[:1024] == prefix for r in requests)
    assert all(r.output_len == 64 for r in requests)
    assert len({r.prompt[1024:] for r in requests}) == 256

    w1, _ = bench.resolve(bench.build_parser().parse_args(["--workload", "W1"]))
    w3, rates = bench.resolve(
        bench.build_parser().parse_args(["--workload", "W3", "--request-rates", "2,8,32"])
    )
    assert rates == [2.0, 8.0, 32.0]
    assert bench.generate_requests(w3, 128256, 8192) == bench.generate_requests(w1, 128256, 8192)
    with pytest.raises(SystemExit):
        bench.resolve(bench.build_parser().parse_args(["--workload", "W3"]))


def test_w4_interleaves_eight_shared_prefixes():
    """Every prefix first (each 1,024 ids), then per request its suffix (fixed lengths draw
    nothing); request i uses prefix i mod 8."""
    workload, rates = bench.resolve(bench.build_parser().parse_args(["--workload", "W4"]))
    assert rates == [math.inf]
    assert workload.num_prefixes == 8
    requests = bench.generate_requests(workload, vocab_size=128256, max_model_len=8192)
    assert len(requests) == 512

    rng = random.Random(1)
    prefixes = [tuple(rng.randrange(1000, 100000) for _ in range(1024)) for _ in range(8)]
    assert len(set(prefixes)) == 8
    for i, req in enumerate(requests):
        assert req.prompt[:1024] == prefixes[i % 8]
        assert req.prompt[1024:] == tuple(rng.randrange(1000, 100000) for _ in range(64))
        assert req.output_len == 64
    assert len({r.prompt[1024:] for r in requests}) == 512

    # A smaller variant for CPU runs: fewer prompts, shorter prefixes, still interleaved.
    small, _ = bench.resolve(
        bench.build_parser().parse_args(["--workload", "W4", "--num-prompts", "16", "--prefix-len", "32"])
    )
    small_requests = bench.generate_requests(small, vocab_size=512, max_model_len=256)
    assert [r.prompt[:32] for r in small_requests[:8]] == [r.prompt[:32] for r in small_requests[8:]]
    assert len({r.prompt[:32] for r in small_requests}) == 8
    with pytest.raises(SystemExit, match="--num-prefixes needs --dataset shared-prefix"):
        bench.resolve(bench.build_parser().parse_args(["--num-prefixes", "4"]))


@pytest.mark.parametrize(
    "argv",
    [
        ["--input-len", "9:3"],
        ["--input-len", "abc"],
        ["--input-len", "1:"],
        ["--output-len", "0"],
        ["--output-len", "-1"],
        ["--request-rate", "abc"],
        ["--request-rate", "nan"],
        ["--request-rate", "0"],
        ["--request-rates", "2,abc"],
        ["--request-rates", ","],
        ["--max-concurrency", "0"],
        ["--num-prompts", "0"],
        ["--num-warmups", "-1"],
        ["--temperature", "-1"],
        ["--request-timeout", "0"],
        ["--prefix-len", "-1"],
        ["--baseline-num-prompts", "0"],
        ["--baseline-batch-size", "0"],
    ],
)
def test_a_bad_flag_value_is_an_argparse_error_naming_the_flag(argv, capsys):
    """Not a ValueError traceback (or a hang, or a silent 'unlimited') once the run has begun."""
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*argv, "--port", "1", "--no-plot"])
    assert exit_info.value.code == 2
    assert f"argument {argv[0]}: expected" in capsys.readouterr().err


def test_unusable_setups_fail_before_the_run_with_a_message(tmp_path):
    """Empty prompts, a result file that is a directory, no server, two rate flags, a prefix length
    without a shared prefix: one line each, no traceback."""
    port = ["--port", str(free_port()), "--no-plot", "--result-file", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit, match="--input-len 0 makes empty prompts"):
        bench.main(["--input-len", "0", *port])
    with pytest.raises(SystemExit, match="--result-file .* is a directory"):
        bench.main([*port, "--result-file", str(tmp_path)])
    with pytest.raises(SystemExit, match="no pagedserve server answers at 127.0.0.1:"):
        bench.main(port)
    with pytest.raises(SystemExit, match="not both"):
        bench.main(["--request-rate", "2", "--request-rates", "4,8", *port])
    with pytest.raises(SystemExit, match="--prefix-len needs --dataset shared-prefix"):
        bench.main(["--workload", "W1", "--prefix-len", "64", *port])
    assert not (tmp_path / "r.json").exists()
    args = bench.build_parser().parse_args(["--workload", "W2", "--prefix-len", "64"])
    assert bench.resolve(args)[0].prefix_len == 64  # the preset's shared-prefix dataset takes it


def test_explicit_flags_override_the_preset():
    args = bench.build_parser().parse_args(["--workload", "W1", "--num-prompts", "8", "--output-len", "5"])
    workload, _ = bench.resolve(args)
    assert workload.num_prompts == 8
    assert workload.output_len == LengthRange(5, 5)
    assert workload.input_len == LengthRange(128, 1024)


def test_w6_is_conversations_whose_turns_follow_each_other():
    """W6: 64 conversations x 6 turns of 256 new tokens and 128 answer tokens, 0.5 s apart; request
    c * 6 + t is conversation c's turn t, carrying only its own new tokens (the sender prepends the
    conversation so far: tests/test_kv_tier_e2e.py runs it)."""
    workload, rates = bench.resolve(bench.build_parser().parse_args(["--workload", "W6"]))
    assert (workload.dataset, workload.num_prompts, workload.num_turns) == ("multi-turn", 64, 6)
    assert workload.think_time == 0.5 and rates == [float("inf")]
    requests = bench.generate_requests(workload, vocab_size=128256)
    assert len(requests) == 384
    assert [(r.conversation, r.turn) for r in requests[5:8]] == [(0, 5), (1, 0), (1, 1)]
    assert all(len(r.prompt) == 256 and r.output_len == 128 and r.think_time == 0.5 for r in requests)
    with pytest.raises(SystemExit, match="--num-turns needs --dataset multi-turn"):
        bench.resolve(bench.build_parser().parse_args(["--workload", "W1", "--num-turns", "3"]))


def test_w7_prompts_are_standard_library_files_with_an_edit_request():
    """W7: 32 standard-library files (each used once, seeded) cut to 512-1,024 tokens of the model's
    tokenizer, then a line asking to repeat a function defined in the cut; 256 output tokens."""
    from transformers import AutoTokenizer

    from pagedserve.common.default_model import DEFAULT_MODEL_DIR

    with pytest.raises(SystemExit, match="W7 .* needs --model"):
        bench.resolve(bench.build_parser().parse_args(["--workload", "W7"]))
    args = bench.build_parser().parse_args(["--workload", "W7", "--model", str(DEFAULT_MODEL_DIR)])
    workload, _ = bench.resolve(args)
    requests = bench.generate_requests(workload, vocab_size=8192, max_model_len=2048)
    assert len(requests) == 32 and all(r.output_len == 256 for r in requests)
    assert all(512 <= len(r.prompt) <= 1024 + 40 for r in requests)
    assert len({r.prompt[:64] for r in requests}) == 32  # no file twice: no prefix-cache hits
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    text = tokenizer.decode(requests[0].prompt)
    name = text.rsplit("# Repeat the function `", 1)[1].split("`", 1)[0]
    assert f"def {name}(" in text and text.endswith(f"rename it to `{name}_v2`.\n")
    assert bench.generate_requests(workload, vocab_size=8192, max_model_len=2048) == requests


def test_small_vocabulary_and_context_are_respected():
    workload = Workload("random", 50, LengthRange(100, 300), LengthRange(100, 300), seed=3)
    requests = bench.generate_requests(workload, vocab_size=512, max_model_len=256)
    assert bench.token_id_range(512) == (256, 512)
    assert bench.token_id_range(128256) == (1000, 100000)
    for r in requests:
        assert all(256 <= t < 512 for t in r.prompt)
        assert len(r.prompt) + r.output_len <= 256
        assert r.output_len >= 1


def test_poisson_arrivals_are_seeded_and_start_at_zero():
    assert bench.arrival_times(4, math.inf, seed=1) == [0.0] * 4
    times = bench.arrival_times(2000, 8.0, seed=1)
    assert times == bench.arrival_times(2000, 8.0, seed=1)
    assert times[0] == 0.0
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    assert 0.1 < times[-1] / 1999 < 0.15  # mean gap 1/8 s, loosely


# ---------------------------------------------------------------------------------------------
# Metrics and report from synthetic records


def synthetic_pass(label: str = "rate inf") -> PassResult:
    # Request 0: sent at 10.0, first token 10.1, then messages of 1 and 2 tokens 0.02 and 0.06 s later.
    r0 = RequestRecord(0, prompt_len=10, max_tokens=4, start=10.0, end=10.2)
    r0.message_times, r0.message_tokens, r0.token_ids = [10.1, 10.12, 10.18], [1, 1, 2], [5, 6, 7, 8]
    r1 = RequestRecord(1, prompt_len=20, max_tokens=2, start=10.0, end=11.5)
    r1.message_times, r1.message_tokens, r1.token_ids = [10.5, 11.5], [1, 1], [9, 9]
    r2 = RequestRecord(
        2, prompt_len=30, max_tokens=2, start=10.0, end=10.01, error="RESOURCE_EXHAUSTED: full"
    )
    before = admin_pb2.SchedulerStats(
        num_preemptions=2,
        num_gpu_blocks=100,
        peak_gpu_blocks_in_use=5,
        prompt_tokens_computed=1000,
        prefix_cache_hit_tokens=10,
        prefix_cache_query_tokens=100,
    )
    after = admin_pb2.SchedulerStats(
        num_preemptions=3,
        num_gpu_blocks=100,
        peak_gpu_blocks_in_use=40,
        peak_slot_utilization=0.9,
        prompt_tokens_computed=1030,
        prefix_cache_hit_tokens=40,
        prefix_cache_query_tokens=160,
    )
    return PassResult(
        label,
        math.inf,
        [r0, r1, r2],
        10.0,
        12.0,
        before,
        after,
        sampled_peak_blocks=7,
        sampled_peak_running=2,
    )


def test_latency_metrics_follow_their_definitions():
    r0 = synthetic_pass().records[0]
    assert r0.ttft == pytest.approx(0.1)
    assert r0.tpot == pytest.approx((0.2 - 0.1) / 3)
    assert r0.itls() == pytest.approx([0.02, 0.03, 0.03])

    run = bench.summarize(synthetic_pass())
    assert (run["completed"], run["failed"], run["errors"]) == (2, 1, {"RESOURCE_EXHAUSTED": 1})
    assert run["duration_s"] == pytest.approx(2.0)
    assert run["total_output_tokens"] == 6
    assert run["total_input_tokens"] == 30
    assert run["output_throughput"] == pytest.approx(3.0)
    assert run["total_token_throughput"] == pytest.approx(18.0)
    assert run["request_throughput"] == pytest.approx(1.0)
    assert run["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert run["ttft_ms"]["p50"] == pytest.approx(300.0)
    assert run["e2e_ms"]["p99"] == pytest.approx(200 + 0.99 * 1300)
    assert run["itl_ms"]["p50"] == pytest.approx(30.0)
    assert run["throughput_timeline"] == [5.0, 1.0]
    server = run["server"]
    assert server["preemptions"] == 1
    assert (server["peak_gpu_blocks_in_use"], server["peak_source"]) == (40, "server")
    assert server["peak_running_requests"] == 2
    assert server["prompt_tokens_computed"] == 30
    assert server["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert [r["output_tokens"] for r in run["requests"]] == [4, 2, 0]


def test_server_peak_falls_back_to_sampled_when_the_lifetime_peak_did_not_move():
    result = synthetic_pass()
    result.stats_before.peak_gpu_blocks_in_use = 40
    assert bench.server_metrics(result)["peak_gpu_blocks_in_use"] == 7
    result.stats_after = None
    assert bench.summarize(result)["server"] is None


def test_server_counters_are_left_out_when_the_executor_was_lost_during_the_pass():
    """The core's counters restart with each executor attachment: deltas across a loss are not
    this pass's work (they came out negative), so they are n/a, and the table says why."""
    lost = synthetic_pass()
    lost.stats_after = admin_pb2.SchedulerStats(steps=5, tokens_generated=9)  # detached: no core
    replaced = synthetic_pass()
    replaced.stats_after.prompt_tokens_computed = 10  # a new core since `before` counted 1000
    for result in (lost, replaced):
        server = bench.server_metrics(result)
        assert server["counters_reset"] is True
        assert server["prompt_tokens_computed"] is None
        assert server["preemptions"] is None
        assert server["prefix_cache_hit_rate"] is None
        assert (server["num_gpu_blocks"], server["peak_source"]) == (100, "sampled")
    table = bench.results_table([bench.summarize(lost)])
    row = next(line for line in table.splitlines() if line.startswith("prompt tokens computed"))
    assert row.split()[-1] == "n/a"
    assert "counters restarted" in table
    assert bench.server_metrics(synthetic_pass())["counters_reset"] is False


def test_table_and_plot_are_written(tmp_path):
    passes = [synthetic_pass("prefix caching on"), synthetic_pass("prefix caching off")]
    runs = [bench.summarize(p) for p in passes]
    table = bench.results_table(runs, {"greedy outputs identical": True})
    assert "TTFT p99 (ms)" in table
    assert "peak running requests (sampled)" in table
    assert "prefix caching off" in table
    assert "yes" in table
    assert "RESOURCE_EXHAUSTED: full" in table
    baseline = bench._baseline_summary("hf-static", 2, 4.0, 30, 6, 12, "cpu")
    assert baseline["padding_waste"] == pytest.approx(0.5)
    assert "2.00x" in bench.baseline_table(runs[0], [baseline], total_requests=3)
    bench.write_plot(tmp_path / "plot.png", runs, passes)
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert bench.compare_outputs(passes[0], passes[1]) == {"compared": 2, "identical": True, "differing": []}


# ---------------------------------------------------------------------------------------------
# The client against a fake server


class FakeServer(generation_pb2_grpc.GenerationServicer, admin_pb2_grpc.AdminServicer):
    """Streams max_tokens tokens (two per message after the first); request 3 is refused."""

    def __init__(self) -> None:
        self.seen: list[generation_pb2.GenerateRequest] = []
        self.stats = admin_pb2.SchedulerStats(num_gpu_blocks=64)

    def GetModelInfo(self, request, context):
        return generation_pb2.ModelInfo(model="fake", max_model_len=64, vocab_size=300, block_size=16)

    def Generate(self, request, context):
        self.seen.append(request)
        if request.request_id.endswith("-3"):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        n = request.stopping.max_tokens
        tokens = [len(request.token_ids.ids) + i for i in range(n)]
        self.stats.prompt_tokens_computed += len(request.token_ids.ids)
        yield generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=tokens[:1])
        for i in range(1, n, 2):
            last = i + 2 >= n
            yield generation_pb2.GenerateResponse(
                request_id=request.request_id,
                token_ids=tokens[i : i + 2],
                finish_reason=generation_pb2.FINISH_REASON_LENGTH if last else 0,
            )

    def GetStats(self, request, context):
        return self.stats


@pytest.fixture()
def fake_server():
    server = grpc.server(futures.ThreadPoolExecutor(16))
    fake = FakeServer()
    generation_pb2_grpc.add_GenerationServicer_to_server(fake, server)
    admin_pb2_grpc.add_AdminServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, port
    server.stop(None)


def test_bench_against_a_fake_server(fake_server, tmp_path, capsys):
    fake, port = fake_server
    result = tmp_path / "out" / "bench.json"
    argv = ["--port", str(port), "--num-prompts", "8", "--input-len", "4:80", "--output-len", "1:9"]
    argv += ["--request-rate", "200", "--max-concurrency", "3", "--result-file", str(result)]
    assert bench.main(argv) == 0
    report = json.loads(result.read_text())
    (run,) = report["runs"]
    assert (run["completed"], run["failed"], run["errors"]) == (7, 1, {"RESOURCE_EXHAUSTED": 1})
    requests = bench.generate_requests(Workload("random", 8, LengthRange(4, 80), LengthRange(1, 9)), 300, 64)
    sent = {r.request_id: r for r in fake.seen}
    for req, rec in zip(requests, run["requests"], strict=True):
        msg = sent[f"bench-rate-200-{req.index}"]
        assert tuple(msg.token_ids.ids) == req.prompt
        assert msg.stopping.max_tokens == req.output_len
        assert msg.stopping.ignore_eos
        assert msg.sampling.temperature == 0.0
        assert rec["output_tokens"] == (0 if req.index == 3 else req.output_len)
    assert run["server"]["prompt_tokens_computed"] == sum(len(r.prompt) for r in requests if r.index != 3)
    assert result.with_suffix(".png").exists()
    out = capsys.readouterr().out
    assert "output throughput (tok/s)" in out
    assert "queue full" in out


def test_a_sweep_gives_each_pass_fresh_prompts(fake_server, tmp_path):
    fake, port = fake_server
    result = tmp_path / "sweep.json"
    argv = ["--port", str(port), "--num-prompts", "3", "--input-len", "5", "--output-len", "2"]
    argv += ["--request-rates", "100,inf", "--result-file", str(result), "--no-plot"]
    assert bench.main(argv) == 0
    runs = json.loads(result.read_text())["runs"]
    assert [(r["label"], r["seed"], r["request_rate"]) for r in runs] == [
        ("rate 100", 1, 100.0),
        ("rate inf", 2, "inf"),
    ]
    first = bench.generate_requests(Workload("random", 3, LengthRange(5, 5), LengthRange(2, 2)), 300, 64)
    sent = {r.request_id: tuple(r.token_ids.ids) for r in fake.seen}
    assert [sent[f"bench-rate-100-{i}"] for i in range(3)] == [r.prompt for r in first]
    assert not {sent[f"bench-rate-inf-{i}"] for i in range(3)} & {r.prompt for r in first}
    assert not result.with_suffix(".png").exists()


# ---------------------------------------------------------------------------------------------
# Hugging Face baselines, directly on the tiny model


def test_hf_baselines_count_only_each_requests_own_tokens(tiny_model_dir):
    requests = [
        BenchRequest(0, (5, 6, 7), 3),
        BenchRequest(1, (8, 9, 10, 11, 12), 7),
        BenchRequest(2, (13,), 2),
    ]
    static = bench.run_hf_static(str(tiny_model_dir), requests, batch_size=2, device="cpu")
    # Batches [0, 1] run 7 steps (14 tokens, 10 useful), [2] runs 2 (2 useful).
    assert (static["output_tokens"], static["generated_tokens"]) == (12, 16)
    assert static["padding_waste"] == pytest.approx(0.25)
    from transformers import ContinuousBatchingConfig

    small = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64)  # the default sizes to the RAM
    cb = bench.run_hf_cb(str(tiny_model_dir), requests, device="cpu", cb_config=small)
    assert (cb["output_tokens"], cb["failed"], cb["padding_waste"]) == (12, 0, 0.0)


# ---------------------------------------------------------------------------------------------
# make-model


def test_llama_8b_shape_is_the_one_in_workloads_md():
    shape = SHAPES["llama-8b"]
    assert 2 * shape.num_parameters() == 16_060_522_496  # "Weights 16.06 GB"
    kv_bytes_per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * 2
    assert kv_bytes_per_token == 131072
    config = shape.hf_config(1, 2)
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        4096,
        14336,
        32,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (
        32,
        8,
        128256,
    )
    assert (config["rope_theta"], config["max_position_embeddings"]) == (500000.0, 8192)


def test_make_model_refuses_to_overwrite_weights_or_a_file(tmp_path, capsys):
    """A checkpoint's weights are never clobbered (or mixed with the new model's) without --force."""
    from pagedserve.model_shapes import main as make_model

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "model-00001-of-00002.safetensors").write_bytes(b"real weights")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for argv, message in (
        (["--shape", "tiny", str(existing)], "already holds weights"),
        (["--shape", "tiny", str(a_file)], "is not a directory"),
        (["--shape", "llama-8b-mini", "--device", "tpu", str(tmp_path / "new")], "argument --device"),
        (["--shape", "llama-8b", "--tokenizer-vocab-size", "200000", str(tmp_path / "new")], "vocab_size"),
        (["--shape", "tiny", "--tokenizer-vocab-size", "1000", str(tmp_path / "new")], "benchmark shapes"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            make_model(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert (existing / "model-00001-of-00002.safetensors").read_bytes() == b"real weights"
    assert not (tmp_path / "new").exists()


def test_make_model_trains_a_real_size_tokenizer_on_python_sources(tmp_path, monkeypatch):
    """--tokenizer-vocab-size above the built-in corpus's reach: learnt on this machine's Python
    sources (here a 2 MB share of them), every token id below the shape's vocab_size."""
    from transformers import AutoTokenizer

    from pagedserve import model_shapes

    monkeypatch.setattr(model_shapes, "LARGE_TOKENIZER_TRAIN_BYTES", 2 << 20)
    argv = ["--shape", "llama-8b", "--no-weights", "--tokenizer-vocab-size", "3000", str(tmp_path / "m")]
    assert model_shapes.main(argv) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tokenizer) == 3000  # the built-in corpus yields ~600
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["vocab_size"] == 128256 and config["eos_token_id"] == tokenizer.eos_token_id
    text = "def f(x):\n    return x + 1\n"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_scaled_down_shape_loads_in_transformers(tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = ModelShape(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        rope_theta=500000.0,
        max_position_embeddings=256,
    )
    directory = write_shape_model(tmp_path / "m", shape, progress=False)
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = list(f.keys())
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        norm = f.get_tensor("model.norm.weight")
    assert len(names) == 2 + 9 * 2 + 1
    assert "lm_head.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert q.dtype == torch.bfloat16
    assert tuple(q.shape) == (64, 64)
    assert abs(q.float().std().item() - 0.02) < 0.003
    assert torch.all(norm == 1)

    model = AutoModelForCausalLM.from_pretrained(directory)
    state = model.state_dict()
    assert tuple(state["model.layers.0.self_attn.k_proj.weight"].shape) == (32, 64)
    assert tuple(state["model.layers.0.mlp.up_proj.weight"].shape) == (96, 64)
    assert tuple(state["lm_head.weight"].shape) == (1024, 64)
    assert torch.equal(state["model.layers.1.self_attn.q_proj.weight"], q)
    assert AutoTokenizer.from_pretrained(directory).eos_token_id == model.config.eos_token_id

    again = write_shape_model(tmp_path / "again", shape, progress=False)  # seeded: byte-identical
    assert (again / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------
# The whole command against launched tiny-model services


@pytest.mark.slow
def test_launched_bench_with_hf_static_baseline(tiny_model_dir, tmp_path, capsys):
    result = tmp_path / "bench.json"
    argv = ["--launch", "--model", str(tiny_model_dir), "--executor-args", "--device cpu --dtype float32"]
    argv += [
        "--num-prompts",
        "6",
        "--input-len",
        "8:40",
        "--output-len",
        "4:12",
        "--result-file",
        str(result),
    ]
    argv += ["--baseline", "hf-static", "--baseline-num-prompts", "4", "--baseline-device", "cpu"]
    assert bench.main(argv) == 0
    report = json.loads(result.read_text())
    (run,) = report["runs"]
    assert (run["completed"], run["failed"]) == (6, 0)
    assert all(r["output_tokens"] == r["max_tokens"] for r in run["requests"])
    assert run["server"]["prompt_tokens_computed"] >= 1
    (baseline,) = report["baselines"]
    assert baseline["num_requests"] == 4
    assert baseline["output_tokens"] == sum(r["max_tokens"] for r in run["requests"][:4])
    assert result.with_suffix(".png").exists()
    assert "first 4" in capsys.readouterr().out


@pytest.mark.slow
def test_launched_prefix_caching_comparison(tiny_model_dir, tmp_path, capsys):
    result = tmp_path / "w2.json"
    argv = ["--launch", "--model", str(tiny_model_dir), "--executor-args", "--device cpu --dtype float32"]
    argv += ["--dataset", "shared-prefix", "--prefix-len", "64", "--input-len", "8", "--output-len", "6"]
    argv += ["--num-prompts", "6", "--compare-prefix-caching", "--result-file", str(result)]
    assert bench.main(argv) == 0
    report = json.loads(result.read_text())
    on, off = report["runs"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    assert on["completed"] == off["completed"] == 6
    assert on["server"]["prompt_tokens_computed"] < off["server"]["prompt_tokens_computed"]
    assert on["server"]["prefix_cache_hit_tokens"] > 0
    assert off["server"]["prefix_cache_hit_tokens"] == 0
    assert on["cached_prompt_tokens"] > 0
    assert off["cached_prompt_tokens"] == 0
    assert report["comparison"]["greedy outputs identical"] is True
    assert "prefix caching on vs off" in capsys.readouterr().out


@pytest.mark.slow
def test_launched_w4_smoke_over_two_executors(tiny_model_dir, tmp_path, capsys):
    """W4 scaled down for the CPU, through one scheduler over two launched executors: every
    request completes, and the report has what compares two routings (prefill tokens computed,
    output tok/s)."""
    result = tmp_path / "w4.json"
    argv = ["--launch", "--model", str(tiny_model_dir), "--data-parallel-size", "2"]
    argv += ["--executor-args", "--device cpu --dtype float32 --num-gpu-blocks-override 128"]
    argv += ["--workload", "W4", "--num-prompts", "16", "--prefix-len", "48", "--input-len", "8"]
    argv += ["--output-len", "4", "--result-file", str(result), "--no-plot"]
    assert bench.main(argv) == 0
    report = json.loads(result.read_text())
    assert report["config"]["workload_resolved"]["num_prefixes"] == 8
    (run,) = report["runs"]
    assert (run["completed"], run["failed"]) == (16, 0)
    assert all(r["output_tokens"] == 4 for r in run["requests"])
    assert run["total_input_tokens"] == 16 * (48 + 8)
    assert run["output_throughput"] > 0
    assert 1 <= run["server"]["prompt_tokens_computed"] <= run["total_input_tokens"]
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["executor-0.log", "executor-1.log", "scheduler.log"]
    out = capsys.readouterr().out
    assert "prompt tokens computed" in out
    assert "output throughput (tok/s)" in out


def test_pass_peaks_follow_the_samples():
    """A pass's peaks come from the GetStats samples taken while it runs: the most blocks (with the
    slot utilization at that moment) and the most running requests, each at its own sample."""
    peaks = bench_client.PassPeaks()
    for blocks, util, running in ((10, 0.5, 4), (30, 0.9, 2), (20, 0.7, 6)):
        peaks.update(
            admin_pb2.SchedulerStats(gpu_blocks_in_use=blocks, slot_utilization=util, num_running=running)
        )
    peaks.update(None)  # a failed read changes nothing
    assert (peaks.blocks, peaks.slot_utilization, peaks.running) == (30, pytest.approx(0.9), 6)
    result = peaks.result("p", math.inf, [], 0.0, 1.0, None, None)
    assert (result.sampled_peak_blocks, result.sampled_peak_running) == (30, 6)


def test_launch_places_tensor_parallel_executors_on_their_own_gpus(tiny_model_dir, tmp_path, monkeypatch):
    """`--executor-args "-tp 2"` reaches the placement, so that on CUDA each launched executor gets
    its own 2 GPUs (CUDA_VISIBLE_DEVICES) instead of one."""
    from pagedserve.bench import launch

    seen = {}

    def place(n, **kwargs):  # the placement is all this test is about: stop the launch there
        seen.update(kwargs, n=n)
        raise launch.LaunchError("placed")

    monkeypatch.setattr(launch, "place_executors", place)
    argv = ["--launch", "--model", str(tiny_model_dir), "--executor-args", "--device cpu -tp 2"]
    argv += ["--num-prompts", "1", "--result-file", str(tmp_path / "r.json"), "--no-plot"]
    with pytest.raises(SystemExit, match="placed"):
        bench.main(argv)
    assert (seen["n"], seen["tensor_parallel_size"]) == (1, 2)


def test_free_port_is_below_the_ephemeral_range_and_never_handed_out_twice():
    """Outgoing connections take their source ports from the ephemeral range; a port picked there
    could be taken before the service binds it (CI once saw an executor's metrics port lost so)."""
    import socket

    from pagedserve.bench.launch import _ephemeral_ports

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(port not in _ephemeral_ports() for port in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free indeed


def _ports_of_a_fresh_process(queue, done) -> None:
    """Reports 20 ports, then lives (holding its slice) until `done` is set."""
    from pagedserve.bench.launch import free_port

    queue.put([free_port() for _ in range(20)])
    done.wait(60)


def test_processes_that_pick_ports_at_once_pick_from_slices_of_their_own(monkeypatch):
    """CI once saw two test workers pick one port: each checked it free, and the second service to
    bind it, seconds later, failed. Each process picks from a slice of the range no other holds."""
    import multiprocessing
    import os

    from pagedserve.bench import launch

    mine = launch.free_port() // launch.PORT_SLICE  # (slices start at 10,000, a multiple of it)
    ctx = multiprocessing.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=_ports_of_a_fresh_process, args=(queue, done)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        slices = [{port // launch.PORT_SLICE for port in queue.get(timeout=60)} for _ in workers]
    finally:
        done.set()
        for worker in workers:
            worker.join()
    assert all(len(s) == 1 for s in slices), slices  # each process stays in its slice
    assert len({mine, *set.union(*slices)}) == 3, (mine, slices)  # and no two share one

    # A forked child inherits the slice and the parent's record of it, under another pid: it claims
    # a slice of its own (here the parent's lock is still held, as it would be).
    assert launch._slice is not None
    monkeypatch.setattr(launch, "_slice", (os.getpid() + 1, *launch._slice[1:]))
    assert launch.free_port() // launch.PORT_SLICE != mine
