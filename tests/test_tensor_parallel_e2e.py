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

import grpc
import pytest
import torch

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


def _cpu_runner(model_dir: Path, num_blocks: int, quantization: str | None = None):
    """A single-device float32 ModelRunner on the CPU: the reference a TP=2 executor is held to."""
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.runner import ModelRunner

    config = ExecutorConfig(
        model=str(model_dir), device="cpu", dtype="float32", max_model_len=128,
        num_gpu_blocks_override=num_blocks, swap_space=0.01, quantization=quantization,
    )  # fmt: skip
    return ModelRunner.create(config)


def _start_executor(model_dir: Path, log_path: Path, *args: str, port: int = 0) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "pagedserve.executor", f"--model={model_dir}", "--device=cpu",
        "--dtype=float32", f"--port={port or free_port()}", "--max-model-len=128", "--swap-space=0.01", *args,
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


def test_executor_protocol_matches_the_single_device_runner(tiny_model_dir, tmp_path):
    """The TP=2 executor's Step stream against a single-device ModelRunner fed the same plans:
    chunked prefill, prompt logprobs and logprobs (rank 0 alone computes them), a swap round trip,
    a bad plan refused by every rank with nothing applied (the next stream carries on), late masks
    (`_late_masks`), and a new lease (every rank forgets its requests)."""
    import grpc

    from pagedserve.executor.runner import PlanError
    from pagedserve.protos import executor_pb2, executor_pb2_grpc
    from tests.test_executor_service import StepStream
    from tests.toy_scheduler import ToyScheduler

    port, log_path = free_port(), tmp_path / "executor.log"
    proc = _start_executor(tiny_model_dir, log_path, *TP2, "--num-gpu-blocks-override=48", port=port)
    reference = _cpu_runner(tiny_model_dir, num_blocks=48)
    try:
        _wait_serving(proc, log_path)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            for lease in range(2):  # Detach resets every rank (and the reference) before the second
                info = stub.Attach(executor_pb2.AttachRequest(scheduler_id=f"test-{lease}"))
                assert info.device == "cpu, tensor parallel over 2 devices"
                reference.reset()
                # Each rank's swap pool is --swap-space GiB of its (half-size) blocks: twice the reference's.
                num_cpu_blocks = min(info.num_cpu_blocks, reference.kv_cache.num_cpu_blocks)
                sched = ToyScheduler(info.num_gpu_blocks, num_cpu_blocks, info.block_size, seed=lease)
                logprobs = executor_pb2.Sampling(return_prompt_logprobs=True, return_logprobs=True)
                sched.add(
                    1, [5, 17, 99, 3, 250, 7, 7, 31, 400, 12, 8, 64, 65, 66, 67, 90, 91, 92, 11], logprobs
                )
                sched.add(2, [42, 43, 44])
                stream = StepStream(stub, info.lease_epoch)

                def step(plan, stream=stream, sched=sched) -> None:
                    got, want = stream.step(plan), reference.execute(plan)
                    assert list(got.seq_ids) == list(want.seq_ids)
                    assert list(got.token_ids) == list(want.token_ids)
                    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
                    assert [(p.seq_id, p.start) for p in got.prompt_logprobs] == [
                        (p.seq_id, p.start) for p in want.prompt_logprobs
                    ]
                    for g, w in zip(got.prompt_logprobs, want.prompt_logprobs, strict=True):
                        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
                    sched.observe(got)

                step(sched.plan({1: 8, 2: 3}))  # a prefill chunk of seq 1, all of seq 2
                for _ in range(3):
                    step(sched.plan())
                step(sched.plan({2: 1}, swap_out=[1]))
                step(sched.plan(swap_in=[1]))
                bad = executor_pb2.StepPlan(
                    step_id=999, running=[executor_pb2.RunningRequest(seq_id=12345, num_new_tokens=1)]
                )
                with pytest.raises(grpc.RpcError) as err:
                    stream.step(bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(PlanError):
                    reference.execute(bad)
                stream = StepStream(stub, info.lease_epoch)
                for _ in range(4):
                    step(sched.plan(), stream)
                assert len(sched.seqs[1].generated) >= 6
                _late_masks(stream, reference, lease)
                if lease == 1:
                    stream.close()  # its last step awaits masks: the stream's end samples it
                # lease 0: Detach with a step awaiting masks (rank 0 samples it before the RESET)
                stub.Detach(executor_pb2.DetachRequest(lease_epoch=info.lease_epoch))
        assert proc.poll() is None, log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _late_masks(stream, reference, lease: int) -> None:
    """Masks behind the plan on a TP=2 executor (rank 0 alone sees the StepMasks; the worker waits
    in the token broadcast): a decode of seqs 1 and 2, then one whose seq 1 mask follows, equal to
    the single-device runner's; then a third that awaits masks that never come."""
    from pagedserve.protos import executor_pb2

    def decode(step_id: int, late=()) -> executor_pb2.StepPlan:
        running = [executor_pb2.RunningRequest(seq_id=s, num_new_tokens=1) for s in (1, 2)]
        return executor_pb2.StepPlan(step_id=step_id, running=running, late_masked_seq_ids=late)

    first, second = decode(100 + 10 * lease), decode(101 + 10 * lease, late=[1])
    allowed = 77 + lease
    words = [0] * (512 // 32)
    words[allowed // 32] = 1 << (allowed % 32)
    masks = executor_pb2.StepMasks(
        step_id=second.step_id, seq_ids=[1], token_bitmask=b"".join(w.to_bytes(4, "little") for w in words)
    )
    stream.send(first)
    stream.send(second)
    pending = [reference.launch(first), reference.launch(second)]
    assert list(stream.read().token_ids) == list(reference.finish(pending[0]).token_ids)
    reference.apply_masks(pending[1], masks)
    got, want = stream.step(executor_pb2.StepPlan(masks=masks)), reference.finish(pending[1])
    assert list(got.token_ids) == list(want.token_ids) and got.token_ids[0] == allowed
    stream.send(decode(102 + 10 * lease, late=[1, 2]))
    reference.launch(decode(102 + 10 * lease, late=[1, 2]))  # the next reset drops it


def test_fp8_tp2_prompt_logprobs_close_to_fp8_tp1(tiny_model_dir, tmp_path, monkeypatch):
    """--quantization fp8 over two ranks (the CPU references, PAGEDSERVE_FP8_REFERENCE=1): the
    row-parallel FP8 projections (each rank's columns quantized with their own per-row scales)
    give prompt logprobs within FP8 noise of the single-device FP8 model's, and the group serves
    decode steps after."""
    import grpc

    from pagedserve.protos import executor_pb2, executor_pb2_grpc
    from tests.test_executor_service import StepStream
    from tests.toy_scheduler import ToyScheduler

    monkeypatch.setenv("PAGEDSERVE_FP8_REFERENCE", "1")  # inherited by the executor and its worker
    port, log_path = free_port(), tmp_path / "executor.log"
    fp8 = ("--quantization=fp8", "--num-gpu-blocks-override=16")
    proc = _start_executor(tiny_model_dir, log_path, *TP2, *fp8, port=port)
    references = {q: _cpu_runner(tiny_model_dir, num_blocks=16, quantization=q) for q in ("fp8", None)}
    prompt = list(range(3, 40))
    try:
        _wait_serving(proc, log_path)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            info = stub.Attach(executor_pb2.AttachRequest(scheduler_id="test"))
            sched = ToyScheduler(info.num_gpu_blocks, 0, info.block_size)
            sched.add(1, prompt, executor_pb2.Sampling(return_prompt_logprobs=True))
            stream = StepStream(stub, info.lease_epoch)
            plan = sched.plan()
            got = stream.step(plan)
            want = {q: runner.execute(plan) for q, runner in references.items()}
            sched.observe(got)
            for _ in range(4):
                sched.observe(stream.step(sched.plan()))
            assert len(sched.seqs[1].generated) == 5
            stream.close()

        def logprobs(output: executor_pb2.StepOutput) -> torch.Tensor:
            return torch.tensor([lp for p in output.prompt_logprobs for lp in p.logprobs])

        tp2, tp1, full = logprobs(got), logprobs(want["fp8"]), logprobs(want[None])
        assert len(tp2) == len(prompt) - 1
        # A sharding mistake (a scale on the wrong rows) would be far off; FP8 noise is not.
        tp2_error, tp1_error = float((tp2 - full).abs().mean()), float((tp1 - full).abs().mean())
        print(f"mean |prompt logprob - float32|: fp8 TP=2 {tp2_error:.4f}, fp8 TP=1 {tp1_error:.4f}")
        assert tp2_error < 2 * tp1_error + 0.01
        torch.testing.assert_close(tp2, tp1, atol=0.1, rtol=0.05)
        assert proc.poll() is None, log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_restarts_a_group_whose_worker_died(tiny_model_dir, tmp_path):
    """`pagedserve serve -tp 2 --device cpu`: SIGKILL of the worker (serve's grandchild) ends its
    executor, serve restarts the whole group, the same greedy completion comes back, and SIGTERM
    on serve leaves no process of either group."""
    from tests.test_serve_data_parallel import (
        children_of,
        executor_answers,
        executor_pid,
        generate,
        stop,
        wait_for,
    )

    port, executor_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(tiny_model_dir),
             f"--port={port}", f"--executor-port={executor_port}", "-tp", "2", "--device=cpu",
             "--max-num-seqs=8", "--max-num-batched-tokens=256", "--max-model-len=256",
             "--num-gpu-blocks-override=64", "--swap-space=0.01"],
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    groups = []
    try:
        wait_for(lambda: executor_answers(executor_port), 180, "executor not up", serve, log)
        tokens = generate(port)
        executor = executor_pid(serve, executor_port)
        [worker] = _children(executor)
        groups += [executor, worker]
        os.kill(worker, signal.SIGKILL)
        wait_for(
            lambda: (pid := executor_pid(serve, executor_port)) is not None and pid != executor,
            60, "the group was not restarted", serve, log,
        )  # fmt: skip
        wait_for(
            lambda: executor_answers(executor_port), 120, "the restarted group does not listen", serve, log
        )
        assert not _alive(executor) and not _alive(worker)
        restarted = executor_pid(serve, executor_port)
        groups += [restarted, *_children(restarted)]
        assert generate(port) == tokens
        assert "executor.tp_worker_died" in log.read_text() and "serve.child_died" in log.read_text()
    finally:
        code = stop(serve)
    assert code == 0, log.read_text()[-4000:]
    assert not children_of(serve.pid)
    assert len(groups) == 4 and all(_wait_gone(pid, 15) for pid in groups)


def test_serve_two_tensor_parallel_groups_match_hugging_face(tiny_model_dir, hf_model, tmp_path):
    """`pagedserve serve --data-parallel-size 2 -tp 2 --device cpu`: two executors of two ranks each
    (four model processes) behind one scheduler; concurrent greedy requests spread over both groups
    and every completion equals Hugging Face `generate`."""
    from pagedserve.protos import executor_pb2, executor_pb2_grpc
    from tests.test_serve_data_parallel import (
        children_of,
        consecutive_free_ports,
        executor_pid,
        stop,
        wait_for,
    )

    port, executor_port = free_port(), consecutive_free_ports(2)
    ports = (executor_port, executor_port + 1)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(tiny_model_dir),
             f"--port={port}", f"--executor-port={executor_port}", "--data-parallel-size=2", "-tp", "2",
             "--device=cpu", "--max-num-seqs=4", "--max-num-batched-tokens=256", "--max-model-len=256",
             "--num-gpu-blocks-override=64", "--swap-space=0.01"],
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(lambda: _num_attached(port) == 2, 240, "two executors not attached", serve, log)
        groups = [executor_pid(serve, p) for p in ports]
        assert all(len(_children(pid)) == 1 for pid in groups)  # each rank 0 with its one worker
        rng = random.Random(11)
        prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, ThreadPoolExecutor(len(prompts)) as pool:
            requests = [make_request(p, max_tokens=MAX_TOKENS, temperature=0) for p in prompts]
            got = [list(r.token_ids) for r in pool.map(lambda r: generate(channel, r, timeout=300), requests)]
        assert got == [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
        for p in ports:  # both groups served some of them
            with grpc.insecure_channel(f"127.0.0.1:{p}") as channel:
                stats = executor_pb2_grpc.ExecutorStub(channel).GetStats(
                    executor_pb2.GetStatsRequest(), timeout=10
                )
            assert stats.tokens_sampled > 0
    finally:
        code = stop(serve)
    assert code == 0, log.read_text()[-4000:]
    assert not children_of(serve.pid)


def _num_attached(port: int) -> int:
    """Executors the scheduler on `port` holds (`Admin.ListExecutors`); 0 while it does not answer."""
    from pagedserve.protos import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            listed = admin_pb2_grpc.AdminStub(channel).ListExecutors(
                admin_pb2.ListExecutorsRequest(), timeout=2
            )
        except grpc.RpcError:
            return 0
    return sum(e.attached for e in listed.executors)
