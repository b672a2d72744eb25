"""Every supported family end to end: executor and scheduler as processes (tests/services.py), greedy
tokens equal Hugging Face `generate` (float32, eager attention) on tiny random models.

One executor per architecture carries all of its checks: prompts longer than the sliding window
(windows of 12-24 tokens, blocks of 16), a step budget of 24 tokens so every long prompt is
prefilled in chunks that cross window edges, a KV pool so small that requests are pre-empted, and
the same prefix sent twice (a prefix-cache hit). The batch runs twice: behind a scheduler that
pre-empts by swapping, then behind one that pre-empts by recompute (started once the first one is
idle, it attaches as soon as the first one has stopped and its lease has lapsed). Gemma 3 (dense, local/global
layers) and Qwen3-MoE (experts and a dense layer) run with --tensor-parallel-size 2 on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.client import generate, make_request
from pagedserve.common.kv_sizing import blocks_per_sequence
from pagedserve.executor.kv_groups import KVCacheGroups
from pagedserve.executor.loader import load_model_spec
from tests.families import FAMILY_SPECS, LONGROPE_ORIGINAL, write_family_model
from tests.services import (
    REPO,
    Services,
    compose_commands,
    free_port,
    hf_greedy,
    localize,
    running_services,
    wait_for_idle,
    wait_until_ready,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
TENSOR_PARALLEL = {"gemma3", "qwen3_moe"}
MAX_MODEL_LEN, BLOCK_SIZE, STEP_TOKENS = 128, 16, 24
EXECUTOR_ARGS = (
    f"--max-model-len={MAX_MODEL_LEN}",
    f"--max-num-batched-tokens={STEP_TOKENS}",
    "--swap-space=0.001",
    # A stopped scheduler's lease lapses soon (it does not give it up on SIGTERM yet), and the next
    # scheduler attaches.
    "--lease-timeout=3",
)
SCHEDULER_ARGS = (f"--max-num-batched-tokens={STEP_TOKENS}", "--max-num-seqs=8")
# One thread per process: the tiny models gain nothing from more, and two tensor-parallel ranks
# whose threads outnumber the cores wait on each other at every all-reduce (40x slower steps here).
ENV = {"OMP_NUM_THREADS": "1"}


def _prompts(name: str, vocab_size: int) -> tuple[list[list[int]], list[int], list[int]]:
    """The concurrent batch, then two prompts sharing a 40-token prefix (sent one after the other)."""
    rng = random.Random(name)
    # Phi-3: sequences within LongRoPE's original length (64), where transformers' generate and we
    # agree (past it, generate recomputes the whole sequence with the long factors: executor.rotary).
    lengths = [3, 14, 27, 33, 38, 42, 45, 48] if name == "phi3" else [3, 14, 27, 38, 50, 63, 70, 77]
    batch = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]
    prefix = [rng.randrange(3, vocab_size) for _ in range(40)]
    return batch, prefix + [rng.randrange(3, vocab_size) for _ in range(3)], prefix + [7, 8, 9]


def _pool_blocks(model_dir) -> int:
    """A KV pool of 4 blocks more than one max_model_len sequence needs (its KV-cache groups: a
    sliding group needs only its window and a step's tokens), so the 8 requests (up to ~93 tokens
    each) are pre-empted."""
    spec = load_model_spec(model_dir)
    windows = [w if w is not None and w < MAX_MODEL_LEN else None for w in spec.layer_windows]
    groups = KVCacheGroups.for_layers(windows).sliding_windows
    return blocks_per_sequence(MAX_MODEL_LEN, BLOCK_SIZE, groups, STEP_TOKENS) + 4


@pytest.fixture(scope="module", params=list(FAMILY_SPECS))
def family(request, tmp_path_factory):
    name = request.param
    return name, write_family_model(name, tmp_path_factory.mktemp(name))


@contextlib.contextmanager
def _next_scheduler(services: Services, model_dir, args: tuple[str, ...]) -> Iterator[subprocess.Popen]:
    """A second scheduler (`args`) in front of the same executor, started now: it retries its
    attach every second while the first one holds the lease (start it once that one is idle: a
    step slow enough to let the first lease lapse would hand the executor over mid-batch)."""
    cmd = localize(compose_commands()["scheduler"], model_dir, free_port(), services.executor_port)
    log = open(services.log_dir / "scheduler-2.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [*cmd, *args, "--executor-refresh-interval=0.5"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **ENV},
    )
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _hand_over(services: Services, proc: subprocess.Popen) -> None:
    """Stops the scheduler (SIGTERM: it drains); `proc` takes over once the lease has lapsed."""
    services.scheduler.terminate()
    services.scheduler.wait(timeout=30)
    services.scheduler = proc
    services.port = int(next(a for a in proc.args if a.startswith("--port=")).split("=")[1])
    wait_until_ready(services)


def _greedy(services: Services, prompts: list[list[int]]) -> list:
    with services.channel() as channel, ThreadPoolExecutor(len(prompts)) as pool:
        requests = [make_request(p, max_tokens=MAX_TOKENS, temperature=0) for p in prompts]
        return list(pool.map(lambda r: generate(channel, r, timeout=300), requests))


def test_family_greedy_matches_hugging_face(family, tmp_path):
    from transformers import AutoModelForCausalLM

    name, model_dir = family
    batch, first, second = _prompts(name, FAMILY_SPECS[name].vocab_size)
    executor_args = (*EXECUTOR_ARGS, f"--num-gpu-blocks-override={_pool_blocks(model_dir)}")
    executor_args += ("--tensor-parallel-size=2",) if name in TENSOR_PARALLEL else ()
    swap = (*SCHEDULER_ARGS, "--preemption-mode=swap")
    recompute = (*SCHEDULER_ARGS, "--preemption-mode=recompute")
    with running_services(model_dir, tmp_path, executor_args, swap, env=ENV) as services:
        swapping = _greedy(services, batch)
        repeated = [_greedy(services, [prompt])[0] for prompt in (first, second)]
        swap_stats = wait_for_idle(services)
        swapped_in = services.executor_stats().swap_in_blocks
        with _next_scheduler(services, model_dir, recompute) as next_scheduler:
            # While the second scheduler starts: the reference.
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", attn_implementation="eager")
            expected = [hf_greedy(hf.eval(), prompt, MAX_TOKENS) for prompt in batch]
            _hand_over(services, next_scheduler)
            recomputing = _greedy(services, batch)
            recompute_stats = wait_for_idle(services)
    log = (tmp_path / "scheduler-2.log").read_text()
    assert [r.token_ids for r in swapping] == expected, name
    assert [r.token_ids for r in recomputing] == expected, name
    assert [r.token_ids for r in repeated] == [hf_greedy(hf, p, MAX_TOKENS) for p in (first, second)], name
    if name == "phi3":
        assert max(len(p) + len(e) for p, e in zip(batch, expected, strict=True)) <= LONGROPE_ORIGINAL
    assert repeated[1].usage.cached_prompt_tokens >= 32, "the shared prefix was meant to hit"
    assert swap_stats.num_preemptions > 0 and swapped_in > 0, "the pool was meant to be too small"
    assert recompute_stats.num_preemptions > 0 and "mode=recompute" in log
    for stats in (swap_stats, recompute_stats):
        assert stats.gpu_blocks_in_use == 0 and stats.num_active_requests == 0
