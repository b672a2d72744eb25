"""Host time of the draft model's proposal passes (issue 30): one request, k proposals per step.

A verification step with a draft model first runs the draft k times, one token each. On the H200
the built-in model's step spent ~4.6 ms of host time launching them against 1.4 ms of GPU time,
so this measures what the host spends per step: `ModelRunner.launch` as a whole, the proposal
phase (`_draft_proposals`), and the share of it inside the draft's eager forward passes (on the CPU
that is compute; the rest is staging, sampling and bookkeeping: the host cost per pass reported).
On CUDA nothing is synchronised inside the timed calls, so the times are host (launch) times.
Times are the main thread's CPU time (`time.thread_time`, torch on one thread): on a shared machine
wall time mostly measures the neighbours.

    python -m benchmarks.draft_proposals --device cpu
    python -m benchmarks.draft_proposals --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.runner import ModelRunner
from pagedserve.protos import executor_pb2 as pb

ROOT = Path(__file__).resolve().parents[1] / "src" / "pagedserve" / "models"


class _Timer:
    """Wraps a callable and sums the wall time spent in it."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.thread_time() - start
            self.calls += 1


# Host-side staging inside the proposal phase, counted per step: host batches built and host ->
# device copies started (each a pinned buffer, a copy launch and its bookkeeping).
_STAGING = {
    "build_host_batch": ("runner",),
    "int64_to_device": ("runner", "step_inputs", "spec_decode"),
    "to_device": ("spec_decode", "sampler"),
    "pack_int64": ("cuda_graphs",),
}


def _count_staging(counts: dict[str, int], inside: list[bool]) -> None:
    """Wraps the staging helpers where the executor's modules call them, counting calls while
    `inside[0]` (the proposal phase)."""
    import importlib

    for name, modules in _STAGING.items():
        for module_name in modules:
            module = importlib.import_module(f"pagedserve.executor.{module_name}")
            if hasattr(module, name):
                setattr(module, name, _counted(getattr(module, name), name, counts, inside))


def _counted(fn: Callable, name: str, counts: dict[str, int], inside: list[bool]) -> Callable:
    def counted(*args, **kwargs):
        if inside[0]:
            counts[name] = counts.get(name, 0) + 1
        return fn(*args, **kwargs)

    return counted


def _runner(args: argparse.Namespace) -> ModelRunner:
    spec = {"method": "draft_model", "model": str(args.draft), "num_speculative_tokens": args.k}
    config = ExecutorConfig(
        model=str(args.model), device=args.device, dtype=args.dtype, num_gpu_blocks_override=256,
        max_model_len=2048, max_num_seqs=4, swap_space=0.002, speculative_config=spec,
        enforce_eager=args.eager,
    )  # fmt: skip
    return ModelRunner.create(config)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Runs a prompt, then `args.steps` verification steps of k draft proposals; returns per-step
    means (seconds) of launch, the proposal phase and the draft forwards inside it, and the
    staging calls of the proposal phase per step."""
    runner = _runner(args)
    block = runner.block_size
    prompt = np.random.default_rng(0).integers(3, 400, args.prompt_len).tolist()
    blocks = list(range(1, 1 + -(-(args.prompt_len + (args.k + 1) * (args.steps + 2)) // block)))
    plan = pb.StepPlan(step_id=0)
    first = blocks[: -(-len(prompt) // block)]
    sampling = pb.Sampling(temperature=args.temperature, has_seed=True, seed=7)
    plan.new_requests.add(
        seq_id=1, token_ids=prompt, num_computed_tokens=0, num_new_tokens=len(prompt),
        block_tables=[pb.BlockTable(first_index=0, block_ids=first)], sampling=sampling,
    )  # fmt: skip
    runner.execute(plan)
    num_tokens, end = len(prompt) + 1, len(first)
    forward = runner.draft.forward = _Timer(runner.draft.forward)
    inner = [0.0]  # the draft forwards' seconds inside the proposal phase
    counts: dict[str, int] = {}
    inside = [False]
    _count_staging(counts, inside)

    def proposal_phase(*a, _fn=runner._draft_proposals):
        before = forward.seconds
        inside[0] = True
        try:
            return _fn(*a)
        finally:
            inside[0] = False
            inner[0] += forward.seconds - before

    proposals = runner._draft_proposals = _Timer(proposal_phase)
    launch = 0.0
    for step in range(1, args.steps + 1):
        if step == args.warmups + 1:  # reset the timers after warm-up
            proposals.seconds = inner[0] = launch = 0.0
            counts.clear()
        plan = pb.StepPlan(step_id=step)
        running = plan.running.add(seq_id=1, num_new_tokens=1 + args.k, num_draft_tokens=args.k)
        need = -(-(num_tokens + args.k) // block)
        if need > end:
            running.new_blocks.add(first_index=end, block_ids=blocks[end:need])
        start = time.thread_time()
        pending = runner.launch(plan)
        launch += time.thread_time() - start
        out = runner.finish(pending)
        num_tokens += out.num_tokens[0]
        end = -(-(num_tokens - 1) // block)
    steps = args.steps - args.warmups
    return {
        "launch_s": launch / steps,
        "proposals_s": proposals.seconds / steps,
        "draft_forward_s": inner[0] / steps,
        "host_per_pass_s": (proposals.seconds - inner[0]) / steps / args.k,
    } | {f"{name}_per_step": n / steps for name, n in sorted(counts.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "default")
    p.add_argument("--draft", type=Path, default=ROOT / "default_draft")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmups", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = measure(args)
    times = {k: round(v * 1e3, 4) for k, v in result.items() if k.endswith("_s")}
    print(json.dumps(times | {"unit": "ms"} | {k: v for k, v in result.items() if not k.endswith("_s")}))


if __name__ == "__main__":
    main()
