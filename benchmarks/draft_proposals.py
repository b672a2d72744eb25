"""Host time of a draft-model verification step (issue 30): one request, k proposals per step.

At one request the executor's step is bound by the host: the GPU work of the built-in model and its
draft is a fraction of a millisecond, and with speculation nothing is planned ahead, so each step's
host time is on the critical path. This measures, per verification step, the host's time in
`ModelRunner.launch` (all of it: plan, staging, proposal passes, the target's forward, acceptance),
in the proposal phase of the general path (`_draft_proposals`; 0 where the step replays the
proposal, target and acceptance graphs alone, `_verify_in_graphs`: greedy, one request, with
graphs) and the share of it inside the draft's eager forward passes (on the CPU that is compute;
the rest is staging, sampling and bookkeeping: the host cost per pass reported), in `finish` (on
CUDA it includes waiting for the device), and the wall time of the whole step. Then, over a few
more steps, untimed: what each launch does on the host, as counts per step: torch operations
dispatched outside graph replays (each a kernel launch or a view on CUDA), host -> device and
device -> host copies (CUDA), and calls of the staging helpers.
Times are the main thread's CPU time (`time.thread_time`, torch on one thread): on a shared machine
wall time mostly measures the neighbours.

`--graph-layout` (the CPU): the steps run through the CUDA graphs' padded static inputs, uncaptured,
with the graph bodies skipped (a replay is one launch): what remains is the host's work around the
replays, the number that matters on CUDA, without CUDA. Tokens are then not the model's.

    python -m benchmarks.draft_proposals --device cpu --graph-layout
    python -m benchmarks.draft_proposals --device cuda --dtype bfloat16

Before/after a change to the executor, the same benchmark over both (it runs on either):

    for rev in BEFORE HEAD; do git checkout -q $rev -- executor; python -m benchmarks.draft_proposals \
        --device cuda --dtype bfloat16; done; git checkout -q HEAD -- executor
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.cuda_graphs import StepGraphs, decode_graph_sizes, mixed_graph_sizes
from pagedserve.executor.runner import ModelRunner
from pagedserve.protos import executor_pb2 as pb

ROOT = Path(__file__).resolve().parents[1] / "src" / "pagedserve" / "models"


class _Timer:
    """Wraps a callable and sums the thread time spent in it."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.thread_time() - start
            self.calls += 1


# Host-side staging, counted per step: host batches built, host -> device copies started (each a
# pinned buffer, a copy launch and its bookkeeping), graph input fills and replays.
_STAGING = {
    "build_host_batch": ("runner",),
    "int64_to_device": ("runner", "step_inputs", "spec_decode"),
    "to_device": ("spec_decode", "sampler"),
}
_GRAPH_METHODS = ("_fill", "run", "run_next", "propose", "accept")


def _count_staging(runner: ModelRunner, counts: collections.Counter, inside: list[bool]) -> None:
    """Wraps the staging helpers where the executor's modules call them (and the graphs' fills and
    replays), counting calls while `inside[0]`."""
    for name, modules in _STAGING.items():
        for module_name in modules:
            module = importlib.import_module(f"pagedserve.executor.{module_name}")
            if hasattr(module, name):
                setattr(module, name, _counted(getattr(module, name), name, counts, inside))
    for attr in ("graphs", "draft_graphs"):
        graphs = getattr(runner, attr, None)
        for name in _GRAPH_METHODS if graphs is not None else ():
            setattr(graphs, name, _counted(getattr(graphs, name), f"{attr}.{name}", counts, inside))


def _counted(fn: Callable, name: str, counts: collections.Counter, inside: list[bool]) -> Callable:
    def counted(*args, **kwargs):
        if inside[0]:
            counts[name] += 1
        return fn(*args, **kwargs)

    return counted


class _OpCounter(TorchDispatchMode):
    """Counts the torch operations dispatched (a graph replay dispatches none of its own), and
    the copies between host and device among them."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counts["torch_ops"] += 1
        name = func.overloadpacket.__name__
        if name in ("copy_", "_to_copy"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else kwargs.get("device") or src.device
            if src.device.type == "cpu" and torch.device(dst).type == "cuda":
                self.counts["host_to_device"] += 1
            elif src.device.type == "cuda" and torch.device(dst).type == "cpu":
                self.counts["device_to_host"] += 1
        return func(*args, **kwargs)


def _runner(args: argparse.Namespace) -> ModelRunner:
    spec = {"method": "draft_model", "model": str(args.draft), "num_speculative_tokens": args.k}
    config = ExecutorConfig(
        model=str(args.model), device=args.device, dtype=args.dtype, num_gpu_blocks_override=256,
        max_model_len=2048, max_num_seqs=4, swap_space=0.002, speculative_config=spec,
        enforce_eager=args.eager,
    )  # fmt: skip
    runner = ModelRunner.create(config)
    if args.graph_layout:
        _through_graph_layouts(runner, args.k)
    return runner


def _through_graph_layouts(runner: ModelRunner, k: int) -> None:
    """The CPU: the runner's graphs, the sizes CUDA would capture, uncaptured and with their bodies
    (what a replay runs on the device) skipped."""
    from pagedserve.executor.cuda_graphs import PROPOSAL_GRAPH_MAX_SEQS

    sizes = decode_graph_sizes(runner.max_num_seqs)
    mixed = mixed_graph_sizes(runner.max_num_batched_tokens, runner.max_num_seqs, runner.max_model_len)
    for attr, model, caches in (
        ("graphs", runner.model, runner._layer_caches),
        ("draft_graphs", runner.draft, runner._draft_caches),
    ):
        graphs = StepGraphs(model, caches, runner.slots, sizes, mixed)
        graphs._forward = lambda num_tokens, mixed: None
        graphs.run, graphs.run_next = graphs.run_uncaptured, graphs.run_next_uncaptured
        if attr == "draft_graphs":
            graphs.prepare_proposals(k, PROPOSAL_GRAPH_MAX_SEQS)
            graphs._propose = lambda size, num_passes: None
            graphs.propose = graphs.propose_uncaptured
            graphs.prepare_acceptance(runner.graphs.logits)
            graphs._accept = lambda size: None
            graphs._accepted[:, -1] = 1  # what the skipped bodies leave: a count of 1 (no proposal kept)
            graphs.accept = graphs.accept_uncaptured
        setattr(runner, attr, graphs)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Runs a prompt, then `args.steps` verification steps of k draft proposals (and
    `args.count_steps` more, counted); returns per-step means (seconds) of launch, the proposal
    phase and the draft forwards inside it, finish and the step's wall time, then the counts."""
    runner = _runner(args)
    block = runner.block_size
    total_steps = args.steps + args.count_steps
    prompt = np.random.default_rng(0).integers(3, 400, args.prompt_len).tolist()
    blocks = list(range(1, 1 + -(-(args.prompt_len + (args.k + 1) * (total_steps + 2)) // block)))
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
    counts: collections.Counter = collections.Counter()
    inside = [False]
    _count_staging(runner, counts, inside)

    def proposal_phase(*a, _fn=runner._draft_proposals):
        before = forward.seconds
        try:
            return _fn(*a)
        finally:
            inner[0] += forward.seconds - before

    proposals = runner._draft_proposals = _Timer(proposal_phase)
    launch = finish = wall = 0.0
    emitted = 0
    ops = _OpCounter()
    for step in range(1, total_steps + 1):
        if step == args.warmups + 1:  # reset the timers after warm-up
            proposals.seconds = inner[0] = launch = finish = wall = 0.0
            emitted = 0
        counting = step > args.steps
        if step == args.steps + 1:  # the timed steps are done: their proposal phases' totals
            timed = (proposals.seconds, inner[0])
        plan = pb.StepPlan(step_id=step)
        running = plan.running.add(seq_id=1, num_new_tokens=1 + args.k, num_draft_tokens=args.k)
        need = -(-(num_tokens + args.k) // block)
        if need > end:
            running.new_blocks.add(first_index=end, block_ids=blocks[end:need])
        start_wall, start = time.perf_counter(), time.thread_time()
        inside[0] = counting
        if counting:
            with ops:
                pending = runner.launch(plan)
        else:
            pending = runner.launch(plan)
        inside[0] = False
        launched = time.thread_time()
        out = runner.finish(pending)
        if not counting:
            launch += launched - start
            finish += time.thread_time() - launched
            wall += time.perf_counter() - start_wall
            emitted += out.num_tokens[0]
        num_tokens += out.num_tokens[0]
        end = -(-(num_tokens - 1) // block)
    if not args.count_steps:
        timed = (proposals.seconds, inner[0])
    steps = args.steps - args.warmups
    per_count = max(args.count_steps, 1)
    return {
        "launch_s": launch / steps,
        "proposals_s": timed[0] / steps,
        "draft_forward_s": timed[1] / steps,
        "host_per_pass_s": (timed[0] - timed[1]) / steps / args.k,
        "finish_s": finish / steps,
        "step_wall_s": wall / steps,
        "tokens_per_step": emitted / steps,
    } | {f"{name}_per_step": n / per_count for name, n in sorted((counts + ops.counts).items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "default")
    p.add_argument("--draft", type=Path, default=ROOT / "default_draft")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmups", type=int, default=5)
    p.add_argument("--count-steps", type=int, default=5, help="untimed steps whose work is counted")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--graph-layout", action="store_true", help="CPU: through the graphs' layouts, bodies skipped"
    )
    args = p.parse_args()
    if args.graph_layout and args.device != "cpu":
        p.error("--graph-layout is for the CPU (CUDA replays real graphs)")
    torch.set_num_threads(1)
    result = measure(args)
    times = {k: round(v * 1e3, 4) for k, v in result.items() if k.endswith("_s")}
    rest = {k: round(v, 2) for k, v in result.items() if not k.endswith("_s")}
    print(json.dumps(times | {"unit": "ms"} | rest))


if __name__ == "__main__":
    main()
