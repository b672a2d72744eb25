"""Memory pressure end to end: a KV pool so small that requests are pre-empted again and again,
in each preemption mode (with and without speculative decoding), and every greedy completion still
equals Hugging Face `generate`."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.client import generate, make_request
from tests.services import hf_greedy, running_services, wait_for_idle

pytestmark = pytest.mark.slow

NUM_BLOCKS = 24  # 384 token slots for 16 requests of up to ~100 tokens each
MAX_TOKENS = 40


@pytest.mark.parametrize(
    ("mode", "speculation"),
    [("recompute", None), ("swap", None), ("swap", "ngram")],
)
def test_preemption_keeps_greedy_outputs_exact(mode, speculation, tiny_model_dir, hf_model, tmp_path):
    """With speculative decoding too: requests swapped out with proposals in flight, their slots
    reserved and trimmed under pressure (n-gram proposals; a draft model under pre-emption is in
    tests/test_spec_decode_e2e.py)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(10, 60))] for _ in range(16)]
    executor_args = (f"--num-gpu-blocks-override={NUM_BLOCKS}", "--max-model-len=128", "--swap-space=0.01")
    scheduler_args = (f"--preemption-mode={mode}", "--max-num-batched-tokens=256")
    if speculation is not None:
        spec = {"method": speculation, "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        flag = "--speculative-config=" + json.dumps(spec)
        executor_args, scheduler_args = (*executor_args, flag), (*scheduler_args, flag)
    with running_services(tiny_model_dir, tmp_path, executor_args, scheduler_args) as services:
        with services.channel() as channel, ThreadPoolExecutor(len(prompts)) as pool:
            requests = [make_request(p, max_tokens=MAX_TOKENS, temperature=0) for p in prompts]
            results = list(pool.map(lambda r: generate(channel, r, timeout=300), requests))
        stats = wait_for_idle(services)
        log = services.scheduler_log()
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)
    assert stats.num_preemptions > 0, "the pool was meant to be too small"
    if speculation is not None:
        assert stats.spec_accepted_tokens > 0
    assert stats.gpu_blocks_in_use == 0
    assert stats.num_active_requests == 0
    assert "preempt" in log
