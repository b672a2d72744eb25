"""Workload W2's shape (docs/performance) end to end on the CPU: requests sharing a 1024-token
prefix, each with its own 64-token suffix and 64 greedy output tokens, all submitted at once (64
requests rather than W2's 256: the run without prefix caching computes every prompt, 70K tokens).

With prefix caching on, the prefill tokens actually computed must drop at least 10x against a run
with it off, `Usage.cached_prompt_tokens` must say so, and every greedy output must be identical.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.client import generate, make_request
from pagedserve.tiny_model import TinyModelSpec, write_tiny_model
from tests.services import running_services, scheduler_stats, wait_for_idle

pytestmark = pytest.mark.slow

NUM_REQUESTS, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 64, 1024, 64, 64


@pytest.fixture(scope="module")
def model_2k(tmp_path_factory):
    """The tiny model with room for W2's 1088-token prompts."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-2k"), TinyModelSpec(max_position_embeddings=2048))


def w2_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(2)
    prefix = [rng.randrange(3, vocab_size) for _ in range(PREFIX_LEN)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(SUFFIX_LEN)] for _ in range(NUM_REQUESTS)]


def run_w2(model_dir, log_dir, prefix_caching: bool):
    flag = "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"
    with running_services(model_dir, log_dir, scheduler_args=(flag,)) as services:
        before = scheduler_stats(services)
        requests = [
            make_request(p, max_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0) for p in w2_prompts(512)
        ]
        with services.channel() as channel, ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda r: generate(channel, r, timeout=600), requests))
        after = wait_for_idle(services)
    return results, after.prompt_tokens_computed - before.prompt_tokens_computed, after


def test_w2_prefix_caching_cuts_prefill_tenfold(model_2k, tmp_path):
    cached, computed_on, stats_on = run_w2(model_2k, tmp_path / "on", prefix_caching=True)
    uncached, computed_off, _ = run_w2(model_2k, tmp_path / "off", prefix_caching=False)
    total_prompt = NUM_REQUESTS * (PREFIX_LEN + SUFFIX_LEN)
    assert computed_off == total_prompt
    assert computed_on * 10 <= computed_off, (computed_on, computed_off)
    assert [r.token_ids for r in cached] == [r.token_ids for r in uncached]
    reused = sum(r.usage.cached_prompt_tokens for r in cached)
    assert reused == total_prompt - computed_on
    assert all(r.usage.cached_prompt_tokens == 0 for r in uncached)
    assert stats_on.prefix_cache_hit_tokens >= reused
