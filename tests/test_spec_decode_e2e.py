"""Speculative decoding end to end on the CPU (real services, the tiny model): with n-gram proposals
greedy outputs equal Hugging Face's (and so the run without speculation), a seeded sampled output
equals the one without speculation token for token (point-mass acceptance draws the sampler's own
per-(seed, position) noise), stop tokens, stop strings and max_tokens end the request where they
fall even inside an accepted run, every block comes back, and a bad config fails at start. With a
draft model (the tiny model with perturbed weights: some proposals right, some wrong), under
chunked prefill and pre-emption: greedy outputs equal Hugging Face's, a seeded sampled request repeats itself,
blocks come back, and a scheduler configured for a draft refuses an executor without it."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from pagedserve.client import generate, make_request
from tests.services import (
    REPO,
    hf_greedy,
    perturbed_copy,
    running_services,
    scheduler_stats,
    wait_for_idle,
)

pytestmark = pytest.mark.slow

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
)
# Prompts whose greedy continuations repeat (the tiny random model loops), so proposals are accepted.
PROMPTS = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8], [40, 41, 42, 40, 41], list(range(100, 140)), [3, 4] * 12]


@pytest.fixture(scope="module")
def ngram_services(tiny_model_dir, tmp_path_factory):
    flag = f"--speculative-config={NGRAM}"
    log_dir = tmp_path_factory.mktemp("spec-ngram")
    # A small pool of 16-token blocks: proposals' slots are reserved and trimmed under pressure too.
    with running_services(
        tiny_model_dir,
        log_dir,
        executor_args=("--num-gpu-blocks-override=48", "--max-model-len=256", flag),
        scheduler_args=(flag,),
    ) as services:
        yield services


@pytest.fixture(scope="module")
def plain_services(tiny_model_dir, tmp_path_factory):
    with running_services(tiny_model_dir, tmp_path_factory.mktemp("spec-off")) as services:
        yield services


def _run(services, requests):
    with services.channel() as channel, ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda r: generate(channel, r, timeout=120), requests))


def test_ngram_greedy_equals_hf_and_every_block_comes_back(ngram_services, hf_model):
    before = scheduler_stats(ngram_services)
    requests = [make_request(p, max_tokens=40, ignore_eos=True, temperature=0) for p in PROMPTS]
    results = _run(ngram_services, requests)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == hf_greedy(hf_model, prompt, 40)
        assert result.usage.completion_tokens == 40
    stats = wait_for_idle(ngram_services)
    assert stats.gpu_blocks_in_use == 0 and stats.num_active_requests == 0
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    assert accepted > 40, "the repeating outputs should have accepted proposals"
    assert stats.spec_draft_tokens >= stats.spec_accepted_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_accepted_tokens
    assert stats.tokens_generated - before.tokens_generated == 40 * len(PROMPTS)
    # An accepted run goes out as one message: fewer messages than tokens.
    assert sum(r.num_messages for r in results) < 40 * len(PROMPTS)


def test_seeded_sampling_equals_the_run_without_speculation(ngram_services, plain_services):
    """Seeded sampling (top-k, top-p), logprobs of every emitted token, and min_tokens banning a
    stop token inside accepted runs: the same as without speculation."""
    requests = [
        make_request(p, max_tokens=32, ignore_eos=True, temperature=0.8, top_k=20, seed=11 + i)
        for i, p in enumerate(PROMPTS)
    ]
    requests += [
        make_request(PROMPTS[0], max_tokens=24, temperature=0.7, top_p=0.9, seed=3, return_logprobs=True),
        make_request(PROMPTS[3], max_tokens=24, temperature=0, return_logprobs=True),
        # 140 is the greedy output's most frequent token: banned until 12 tokens, then a stop.
        make_request(PROMPTS[0], max_tokens=24, temperature=0, min_tokens=12, stop_token_ids=[140]),
    ]
    with_spec = _run(ngram_services, requests)
    without = _run(plain_services, requests)
    assert [r.token_ids for r in with_spec] == [r.token_ids for r in without]
    assert [r.finish_reason for r in with_spec] == [r.finish_reason for r in without]
    for spec_result, plain_result in zip(with_spec[-3:-1], without[-3:-1], strict=True):
        assert len(spec_result.logprobs) == len(spec_result.token_ids)
        assert spec_result.logprobs == pytest.approx(plain_result.logprobs, abs=1e-4)
    assert len(with_spec[-1].token_ids) >= 12
    assert wait_for_idle(ngram_services).gpu_blocks_in_use == 0


def test_constrained_requests_speculate_within_their_grammar(ngram_services, plain_services):
    """Structured outputs with n-gram proposals: proposals are cut where the grammar stops allowing
    them, each verified position samples within its own mask, and outputs equal the run without
    speculation (repetitive constraints, so that proposals are made and accepted)."""
    constraints = [
        {"regex": "(ab ){6}(cd ){6}[0-9]{4}"},
        {"choice": ["one two one two one two one two", "three"]},
        {
            "json": {
                "type": "object",
                "properties": {"a": {"type": "string", "maxLength": 40}},
                "required": ["a"],
            }
        },
    ]
    requests = [
        make_request(PROMPTS[i % 2], max_tokens=48, temperature=t, seed=4, structured_outputs=c)
        for i, c in enumerate(constraints)
        for t in (0, 0.9)
    ]
    before = scheduler_stats(ngram_services)
    with_spec = _run(ngram_services, requests)
    without = _run(plain_services, requests)
    assert [r.text for r in with_spec] == [r.text for r in without]
    assert [r.token_ids for r in with_spec] == [r.token_ids for r in without]
    assert with_spec[0].text.startswith("ab ab ab ab ab ab cd")
    stats = wait_for_idle(ngram_services)
    assert stats.spec_accepted_tokens > before.spec_accepted_tokens
    assert stats.gpu_blocks_in_use == 0


def test_stops_inside_accepted_runs_end_the_request_there(ngram_services, hf_model, tiny_model_dir):
    """Every cut point of a repeating output: max_tokens, a stop token and a stop string at each of
    them end the output exactly there (most fall inside runs of accepted proposals)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = PROMPTS[0]
    full = hf_greedy(hf_model, prompt, 24)
    requests, expected = [], []
    for n in range(1, 13):
        requests.append(make_request(prompt, max_tokens=n, ignore_eos=True, temperature=0))
        expected.append((full[:n], "FINISH_REASON_LENGTH"))
    for token in dict.fromkeys(full[1:16]):  # the first occurrence of each token ends it
        cut = full.index(token)
        requests.append(make_request(prompt, max_tokens=24, stop_token_ids=[token], temperature=0))
        expected.append((full[: cut + 1], "FINISH_REASON_STOP"))
    results = _run(ngram_services, requests)
    for (tokens, reason), result in zip(expected, results, strict=True):
        assert (result.token_ids, result.finish_reason) == (tokens, reason)
    # A stop string: the text ends before it, and no token past the one that completed it arrives.
    text = tokenizer.decode(full, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    result = _run(ngram_services, [make_request(prompt, max_tokens=24, stop=stop, temperature=0)])[0]
    assert result.finish_reason == "FINISH_REASON_STOP" and result.text == text[: text.index(stop)]
    assert result.token_ids == full[: len(result.token_ids)] and len(result.token_ids) < 24
    assert wait_for_idle(ngram_services).gpu_blocks_in_use == 0


def test_executor_crash_mid_stream_resumes_with_the_same_tokens(ngram_services, hf_model):
    """Failover with proposals in flight: the executor dies mid-stream and comes back; the request
    is placed again from its prompt and the tokens already streamed, and ends with exactly the
    greedy tokens of an undisturbed run."""
    from pagedserve.client import stream
    from tests.services import wait_until_ready

    prompt, length = PROMPTS[1], 160
    with ngram_services.channel() as channel:
        responses = stream(channel, make_request(prompt, max_tokens=length, temperature=0), timeout=120)
        tokens = list(next(responses).token_ids)
        ngram_services.restart_executor()
        for response in responses:
            tokens += response.token_ids
    assert tokens == hf_greedy(hf_model, prompt, length)
    assert "requests re-placed" in ngram_services.scheduler_log()
    wait_until_ready(ngram_services)
    assert wait_for_idle(ngram_services).gpu_blocks_in_use == 0


def test_bad_config_fails_at_start_naming_the_field(tiny_model_dir):
    """Both services refuse it as a bad flag (exit 2, the flag and field named; every kind of bad
    value is in tests/test_spec_decode.py)."""
    value = '{"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 2}'
    message = "num_speculative_tokens: must be an integer in [1, 16], got 0"
    for service in ("scheduler", "executor"):
        proc = subprocess.run(
            [sys.executable, "-m", f"pagedserve.{service}", f"--model={tiny_model_dir}",
             "--speculative-config", value],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert f"--speculative-config.{message}" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


# ---- the draft_model method ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):
    return perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("draft") / "draft", scale=0.15)


@pytest.fixture(scope="module")
def draft_services(tiny_model_dir, draft_dir, tmp_path_factory):
    spec = json.dumps({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})
    flag = f"--speculative-config={spec}"
    # A pool too small for all four requests (pre-emption by recompute, the draft's KV recomputed
    # with the target's) and chunked prefill (the draft computes the KV of every chunk). Their
    # peaks are 3, 3, 5 and 4 blocks: in 9, any two of the longer ones running together pre-empt
    # (12 left it to timing: the requests arrive one by one, and under load they overlapped less).
    executor_args = ("--num-gpu-blocks-override=9", "--max-model-len=128", flag)
    scheduler_args = (flag, "--max-num-batched-tokens=16", "--max-num-seqs=8")
    log_dir = tmp_path_factory.mktemp("spec-draft")
    with running_services(tiny_model_dir, log_dir, executor_args, scheduler_args) as services:
        yield services


def test_draft_model_greedy_equals_hf_and_seeded_sampling_repeats(draft_services, hf_model):
    before = scheduler_stats(draft_services)
    requests = [make_request(p, max_tokens=30, ignore_eos=True, temperature=0) for p in PROMPTS]
    results = _run(draft_services, requests)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == hf_greedy(hf_model, prompt, 30)
    stats = wait_for_idle(draft_services)
    assert stats.gpu_blocks_in_use == 0 and stats.num_active_requests == 0
    assert stats.num_preemptions > before.num_preemptions, "the pool was meant to be too small"
    drafted = stats.spec_draft_tokens - before.spec_draft_tokens
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)
    sampled = [
        make_request(p, max_tokens=24, ignore_eos=True, temperature=0.9, seed=5 + i)
        for i, p in enumerate(PROMPTS)
    ]
    # One at a time: with a draft model, which tokens are proposed (and so which noise decides)
    # depends on the step a request shares with others (docs/speculative-decoding.md).
    with draft_services.channel() as channel:
        first = [generate(channel, r, timeout=60) for r in sampled]
        again = [generate(channel, r, timeout=60) for r in sampled]
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert all(len(r.token_ids) == 24 for r in first)
    assert wait_for_idle(draft_services).gpu_blocks_in_use == 0


def test_scheduler_with_a_draft_refuses_an_executor_without_it(draft_dir):
    """A scheduler configured for draft_model admits only an executor that loaded that draft,
    proposing as many tokens (both trim a verified request's tables by the same lookahead)."""
    from pagedserve.scheduler.engine import Engine, ExecutorInfo
    from pagedserve.scheduler.service_config import ServiceConfig

    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    engine = Engine(ServiceConfig(model=str(draft_dir), speculative_config=spec), tokenizer=None)
    info = ExecutorInfo(1, "m", 256, 512, 16, 64, 0, (2,), "cpu")
    refusal = engine.admit_executor(None, info)
    assert "needs the executor to load the draft" in refusal and "it has no draft model" in refusal
    assert "draft model '/elsewhere'" in engine.admit_executor(None, replace(info, draft_model="/elsewhere"))
    info = replace(info, draft_model=str(draft_dir))
    refusal = engine.admit_executor(None, replace(info, num_speculative_tokens=4))
    assert "num_speculative_tokens is 3; the executor's draft proposes 4" in refusal
    assert engine.admit_executor(None, replace(info, num_speculative_tokens=3)) is None


def test_bench_reports_acceptance_and_steps_per_token(tiny_model_dir, tmp_path, capsys):
    """`pagedserve bench --in-process --speculative-config`: the table and the JSON carry the
    acceptance rate, the mean accepted length and the steps per output token."""
    from pagedserve import bench

    result = tmp_path / "bench.json"
    argv = ["--in-process", "--model", str(tiny_model_dir), "--executor-args", "--device cpu --dtype float32"]
    argv += ["--num-prompts", "4", "--input-len", "8:24", "--output-len", "24", "--temperature", "0"]
    argv += ["--speculative-config", NGRAM, "--result-file", str(result), "--no-plot", "--num-warmups", "0"]
    assert bench.main(argv) == 0
    (run,) = json.loads(result.read_text())["runs"]
    server = run["server"]
    assert server["spec_draft_tokens"] > 0
    assert 0 < server["spec_acceptance_rate"] <= 1
    assert 1 < server["spec_mean_accepted_length"] <= 5
    assert 0 < server["steps_per_output_token"] < 1
    assert 0 < run["messages_per_output_token"] < 1  # accepted runs arrive as one message
    out = capsys.readouterr().out
    assert "spec acceptance rate" in out and "executor steps per output token" in out


def test_ngram_under_tensor_parallelism_equals_hf(tiny_model_dir, hf_model, tmp_path):
    """A TP=2 executor (rank 0 and a worker process, gloo) verifies n-gram proposals: every rank
    feeds the verified tokens and advances by rank 0's counts; greedy outputs equal HF's."""
    flag = f"--speculative-config={NGRAM}"
    executor_args = ("--tensor-parallel-size=2", "--num-gpu-blocks-override=48", "--max-model-len=256")
    with running_services(tiny_model_dir, tmp_path, executor_args, (flag,)) as services:
        requests = [make_request(p, max_tokens=32, ignore_eos=True, temperature=0) for p in PROMPTS]
        results = _run(services, requests)
        stats = wait_for_idle(services)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == hf_greedy(hf_model, prompt, 32)
    assert stats.spec_accepted_tokens > 0 and stats.gpu_blocks_in_use == 0
