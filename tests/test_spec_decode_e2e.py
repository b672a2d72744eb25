"""Speculative decoding end to end on the CPU (real services, the tiny model): with n-gram proposals
greedy outputs equal Hugging Face's (and so the run without speculation), a seeded sampled output
equals the one without speculation token for token (point-mass acceptance draws the sampler's own
per-(seed, position) noise), stop tokens, stop strings and max_tokens end the request where they
fall even inside an accepted run, every block comes back, and a bad config fails at start."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.client import generate, make_request
from tests.services import REPO, hf_greedy, running_services, scheduler_stats, wait_for_idle

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
    # Fewer steps than tokens: several tokens per step for the accepted runs.
    assert stats.tokens_generated - before.tokens_generated == 40 * len(PROMPTS)


def test_seeded_sampling_equals_the_run_without_speculation(ngram_services, plain_services):
    requests = [
        make_request(p, max_tokens=32, ignore_eos=True, temperature=0.8, top_k=20, seed=11 + i)
        for i, p in enumerate(PROMPTS)
    ]
    with_spec = _run(ngram_services, requests)
    without = _run(plain_services, requests)
    assert [r.token_ids for r in with_spec] == [r.token_ids for r in without]
    assert wait_for_idle(ngram_services).gpu_blocks_in_use == 0


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
