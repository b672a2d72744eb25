"""Tensor parallelism on the CPU (gloo) end to end: `pagedserve executor --tensor-parallel-size 2`
as real processes (rank 0 serving gRPC, one worker process) behind a real scheduler.

Greedy tokens equal Hugging Face `generate` and the single-device executor (TP=1, in process) on a
GQA model (4 query heads, 2 KV heads: one KV head per rank) under swap preemption (every rank moves
its share of each block), and on a model with one KV head and attention biases (the KV head
replicated on both ranks; the o_proj bias added once, after the all-reduce). Lifecycle: a worker
killed with SIGKILL takes the executor down (non-zero exit, no process left) and the scheduler drops
it; rank 0 killed with SIGKILL leaves no worker behind; SIGTERM on rank 0 stops its worker.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedserve.client import generate, make_request
from pagedserve.tiny_model import TinyModelSpec, write_tiny_model
from tests.services import REPO, free_port, hf_greedy, running_services, scheduler_stats, wait_for_idle

pytestmark = pytest.mark.slow

TP2 = ("--tensor-parallel-size=2",)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def kv1_model_dir(tmp_path_factory) -> Path:
    """One KV head (< 2 ranks: replicated) and q/k/v/o biases."""
    spec = TinyModelSpec(num_key_value_heads=1, attention_bias=True, seed=3)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-kv1"), spec)


def _tp1_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The single-device executor's greedy tokens (in process, through the same scheduler core)."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _greedy(services, prompts: list[list[int]]) -> list[list[int]]:
    with services.channel() as channel, ThreadPoolExecutor(len(prompts)) as pool:
        requests = [make_request(p, max_tokens=MAX_TOKENS, temperature=0) for p in prompts]
        return [list(r.token_ids) for r in pool.map(lambda r: generate(channel, r, timeout=300), requests)]


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc; no psutil here)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_tp2_greedy_matches_tp1_and_hugging_face_under_swap(tiny_model_dir, hf_model, tmp_path):
    """GQA, one KV head per rank; a pool so small that requests are swapped out and in."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(8, 50))] for _ in range(8)]
    executor_args = (*TP2, "--num-gpu-blocks-override=12", "--max-model-len=128", "--swap-space=0.01")
    scheduler_args = ("--preemption-mode=swap", "--max-num-batched-tokens=128", "--max-num-seqs=8")
    with running_services(tiny_model_dir, tmp_path, executor_args, scheduler_args) as services:
        tokens = _greedy(services, prompts)
        stats = wait_for_idle(services)
        executor_stats = services.executor_stats()
        log = services.executor_log()
    assert "executor.tp_rank_ready" in log and "rank=1" in log
    assert stats.num_preemptions > 0 and executor_stats.swap_in_blocks > 0, "meant to swap"
    assert stats.gpu_blocks_in_use == 0 and stats.num_active_requests == 0
    assert tokens == [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    assert tokens == _tp1_greedy(tiny_model_dir, prompts)


def test_tp2_with_replicated_kv_head_matches_tp1_and_hugging_face(kv1_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(kv1_model_dir, dtype="float32").eval()
    prompts = [[5, 6, 7], [20, 30, 40, 50] * 4, list(range(100, 160))]
    with running_services(kv1_model_dir, tmp_path, TP2) as services:
        tokens = _greedy(services, prompts)
    assert tokens == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert tokens == _tp1_greedy(kv1_model_dir, prompts)


def test_worker_killed_takes_the_executor_down(tiny_model_dir, tmp_path):
    """SIGKILL of the worker mid-stream: rank 0 exits non-zero at once, nothing of the group is
    left, and the scheduler drops the executor (its pool leaves the stats)."""
    with running_services(tiny_model_dir, tmp_path, TP2) as services:
        [worker] = _children(services.executor.pid)
        with services.channel() as channel:
            assert generate(
                channel, make_request([5, 6, 7], max_tokens=4, temperature=0), timeout=60
            ).token_ids
        assert scheduler_stats(services).num_gpu_blocks > 0
        os.kill(worker, signal.SIGKILL)
        code = services.executor.wait(timeout=30)
        assert code != 0
        assert not _alive(worker)
        log = services.executor_log()
        assert "executor.tp_worker_died" in log and "returncode=-9" in log
        deadline = time.monotonic() + 60
        while scheduler_stats(services).num_gpu_blocks:
            assert time.monotonic() < deadline, "the scheduler never dropped the lost executor"
            time.sleep(0.2)
        assert services.scheduler.poll() is None


def _start_executor(model_dir: Path, log_path: Path, *args: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "pagedserve.executor", f"--model={model_dir}", "--device=cpu",
        "--dtype=float32", f"--port={free_port()}", "--max-model-len=128", "--swap-space=0.01", *args,
    ]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _wait_serving(proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + 120
    while "executor.serving" not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_rank0_signal_leaves_no_worker(sig, tiny_model_dir, tmp_path):
    """SIGKILL: the worker notices its parent is gone and exits. SIGTERM: rank 0 drains, stops
    the worker (exit 0) and exits 0."""
    log_path = tmp_path / "executor.log"
    proc = _start_executor(tiny_model_dir, log_path, *TP2)
    try:
        _wait_serving(proc, log_path)
        [worker] = _children(proc.pid)
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
        assert _wait_gone(worker, 15), "the worker outlived rank 0"
        if sig == signal.SIGTERM:
            assert code == 0, log_path.read_text()
            assert "returncodes={1: 0}" in log_path.read_text()
        else:
            assert "executor.tp_parent_gone" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
