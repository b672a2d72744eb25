"""Decode-step timing on CUDA: CUDA graphs vs eager, and how much the GPU idles when the executor
is driven the way the service drives it (step N+1 launched before step N is finished).

    python -m benchmarks.step --layers 4 --batches 64,256 --context 512 --steps 30

The model is the "llama-8b-shape" of docs/performance/index.md with `--layers` layers and random bf16 weights,
written as a checkpoint and loaded through the real loader, or with --init-on-device generated on
the GPU (no disk, for all 32 layers). For each batch size, `batch` prompts of `context` tokens are
prefilled, then decode steps are timed:

* direct: plans built up front, fed to ModelRunner.launch/finish one ahead (executor cost only);
  CUDA events around each launch give the GPU idle time *between* steps, and a second pass under
  the torch profiler gives the GPU's busy time (kernels and copies), so idle *within* eager steps
  (the GPU waiting for Python to launch kernels) shows too;
* mixed (--mixed-prompt N, on by default): each step also retires one request and admits a prompt
  of N tokens, the shape continuous batching runs whenever a request finishes;
* service (--service): the same runner behind the real gRPC service, a client thread in this
  process streaming plans with two in flight, as the scheduler engine does.

Prints one table row per (batch, mode), last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import random
import threading
import time
from collections import deque
from pathlib import Path

import grpc
import torch

from benchmarks.ahead_plans import AheadScheduler
from pagedserve.common.tables import markdown_table
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.loader import init_dummy_weights, load_model_spec
from pagedserve.executor.model import CausalLM
from pagedserve.executor.runner import ModelRunner
from pagedserve.model_shapes import INIT_STD, SHAPES
from pagedserve.protos import executor_pb2, executor_pb2_grpc, wire

COPY_BYTES_PER_S = 4.28e12  # shared/bench/WORKLOADS.md: device-to-device copy on the H200


def _init_(name: str, t: torch.Tensor, generator: torch.Generator) -> None:
    """normal(0, 0.02), norms = 1, as `pagedserve make-model` writes them."""
    if name.endswith("norm.weight"):
        t.fill_(1.0)
    else:
        t.normal_(0.0, INIT_STD, generator=generator)


def write_model(directory: Path, layers: int, weights: bool, device: torch.device) -> Path:
    """config.json of llama-8b-shape with `layers` layers, and (if `weights`) random bf16 weights
    generated on `device` and saved with safetensors."""
    shape = dataclasses.replace(SHAPES["llama-8b"], num_hidden_layers=layers)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape.hf_config(1, 2), indent=2))
    if weights:
        from safetensors.torch import save_file

        generator = torch.Generator(device=device).manual_seed(0)
        tensors = {}
        for name, dims in shape.tensor_shapes():
            t = torch.empty(dims, dtype=torch.bfloat16, device=device)
            _init_(name, t, generator)
            tensors[name] = t.cpu()
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def model_on_device(
    directory: Path, max_model_len: int, device: torch.device, quantization: str | None = None
) -> CausalLM:
    """The model of `directory`'s config with random weights generated in place (the executor's
    `--load-format dummy`); with `quantization="fp8"` quantized per row as the loader does."""
    spec = load_model_spec(directory)
    model = CausalLM(spec, max_model_len, device, torch.bfloat16, quantization)
    init_dummy_weights(model, spec, std=INIT_STD)
    return model


def prompts(batch: int, context: int, seed: int = 1) -> dict[int, list[int]]:
    rng = random.Random(seed)
    return {i: [rng.randrange(1000, 100000) for _ in range(context)] for i in range(1, batch + 1)}


def prefill(runner: ModelRunner, batch: int, context: int, max_tokens: int) -> AheadScheduler:
    """Admits `batch` prompts and runs until every request decodes (plus two warm-up steps)."""
    runner.reset()
    sched = AheadScheduler(runner.kv_cache.num_device_blocks, runner.block_size, max_tokens, batch)
    for seq_id, prompt in prompts(batch, context).items():
        sched.add(seq_id, prompt)
    while sched.waiting:
        runner.execute(sched.plan())
    for _ in range(3):
        runner.execute(sched.plan())
    return sched


def _sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def run_direct(runner: ModelRunner, plans: list, events: bool) -> tuple[float, list, list]:
    """Feeds pre-built plans one ahead; returns (wall seconds, start events, end events)."""
    starts, ends = [], []
    in_flight: deque = deque()
    _sync(runner)
    t0 = time.perf_counter()
    for plan in plans:
        if events:
            starts.append(torch.cuda.Event(enable_timing=True))
            starts[-1].record()
        in_flight.append(runner.launch(plan))
        if events:
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
        if len(in_flight) == 2:
            runner.finish(in_flight.popleft())
    while in_flight:
        runner.finish(in_flight.popleft())
    return time.perf_counter() - t0, starts, ends


def gpu_busy_ms(prof) -> float | None:
    """Union of the GPU activity intervals (kernels, copies, memsets) the profiler recorded."""
    try:
        spans = sorted(
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
    except Exception as exc:  # noqa: BLE001 - profiler APIs move between torch releases
        print(f"profiler events unavailable: {exc!r}")
        return None
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / 1000.0 if spans else None


def profiled(fn, cuda: bool):
    """(fn(), GPU busy ms while it ran) - None off CUDA."""
    if not cuda:
        return fn(), None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, gpu_busy_ms(prof)


def mixed_plans(sched: AheadScheduler, steps: int, prompt_len: int) -> list:
    """Plans of continuous batching at its busiest: each step one request finishes and a new one is
    admitted, so every step carries the running decodes plus one whole prompt."""
    plans, next_id = [], max(sched.outputs) + 1
    for _ in range(steps):
        sched.retire(next(iter(sched.num_tokens)))
        sched.add(next_id, prompts(1, prompt_len, seed=next_id)[1])
        next_id += 1
        plans.append(sched.plan())
    return plans


def measure_direct(runner: ModelRunner, sched: AheadScheduler, steps: int, mixed_prompt: int = 0) -> dict:
    """Timing of `steps` decode steps (or, with mixed_prompt, steps that also admit a prompt)."""
    cuda = runner.device.type == "cuda"

    def make_plans() -> list:
        if mixed_prompt:
            return mixed_plans(sched, steps, mixed_prompt)
        return [sched.plan() for _ in range(steps)]

    plans = make_plans()
    wall, starts, ends = run_direct(runner, plans, events=cuda)
    between_idle = None
    if cuda:
        torch.cuda.synchronize()
        gaps = [max(0.0, ends[i].elapsed_time(starts[i + 1])) for i in range(steps - 1)]
        between_idle = sum(gaps) / starts[0].elapsed_time(ends[-1])
    plans = make_plans()
    wall2, busy = profiled(lambda: run_direct(runner, plans, events=False)[0], cuda)
    return {
        "wall_ms": 1000 * wall / steps,
        "between_idle": between_idle,
        "busy_ms": None if busy is None else busy / steps,
        "idle": None if busy is None else 1 - busy / (1000 * wall2),
    }


def measure_service(runner: ModelRunner, batch: int, context: int, steps: int, max_tokens: int) -> dict:
    """The runner behind the gRPC service; a client thread plays the scheduler engine."""
    from pagedserve.executor.service import ExecutorServer

    config = ExecutorConfig(model="bench", port=0, device=runner.device.type)
    server = ExecutorServer(config, runner=runner).start()
    window: dict = {}
    decoding, done = threading.Event(), threading.Event()

    def client() -> None:
        with grpc.insecure_channel(server.address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            info = stub.Attach(executor_pb2.AttachRequest(scheduler_id="bench"))
            sched = AheadScheduler(info.num_gpu_blocks, info.block_size, max_tokens, batch)
            for seq_id, prompt in prompts(batch, context).items():
                sched.add(seq_id, prompt)
            plans: queue.Queue = queue.Queue()
            outputs = stub.Step(iter(plans.get, None), metadata=wire.lease_metadata(info.lease_epoch))
            in_flight, decode_steps = 0, -5
            while decode_steps < steps:
                if not sched.waiting:
                    decode_steps += 1
                    if decode_steps == 0:
                        decoding.set()
                        window["t0"] = time.perf_counter()
                plans.put(sched.plan())
                in_flight += 1
                if in_flight == 2:
                    sched.observe(next(outputs))
                    in_flight -= 1
            window["t1"] = time.perf_counter()
            sched.observe(next(outputs))
            plans.put(None)
        done.set()

    thread = threading.Thread(target=client)
    thread.start()
    decoding.wait(300)
    _, busy = profiled(lambda: done.wait(300), runner.device.type == "cuda")
    thread.join()
    server.stop(grace=1)
    wall = window["t1"] - window["t0"]
    return {
        "wall_ms": 1000 * wall / steps,
        "between_idle": None,
        "busy_ms": None if busy is None else busy / steps,
        "idle": None if busy is None else 1 - busy / (1000 * wall),
    }


def main(argv: list[str] | None = None) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--init-on-device", action="store_true", help="weights made on the GPU")
    parser.add_argument("--service", action="store_true", help="also time through the gRPC service")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/llama-8b-shape"))
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script only")
    parser.add_argument(
        "--mixed-prompt", type=int, default=512,
        help="also time mixed steps: the decodes plus one admitted prompt of this many tokens (0: off)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    max_tokens = 8192

    device = torch.device(args.device)
    directory = write_model(args.model_dir / f"{args.layers}l", args.layers, not args.init_on_device, device)
    config = ExecutorConfig(
        model=str(directory), device=args.device, max_model_len=2048, cpu_kv_cache_space=1,
        max_num_seqs=max(batches), max_num_batched_tokens=max_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, swap_space=0,
    )  # fmt: skip
    t0 = time.perf_counter()
    if args.init_on_device:
        runner = ModelRunner.from_model(config, model_on_device(directory, 2048, device))
    else:
        runner = ModelRunner.create(config)
    graphs = runner.graphs
    print(f"runner ready in {time.perf_counter() - t0:.1f} s, {runner.kv_cache.num_device_blocks} KV blocks")
    if graphs is not None:
        print(
            f"{graphs.num_graphs} graphs captured in {graphs.capture_seconds:.2f} s; they took "
            f"{graphs.device_bytes / 2**20:.0f} MiB of device memory, the KV sizing reserved "
            f"{runner.graph_reserve_bytes / 2**20:.0f} MiB"
        )
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_token_bytes = runner.kv_cache.layout.bytes_per_block // runner.block_size
    rows = []
    for batch in batches:
        sched = prefill(runner, batch, args.context, max_tokens)
        kv_bytes = batch * (args.context + 2 * args.steps) * kv_token_bytes
        floor_ms = 1000 * (weight_bytes + kv_bytes) / COPY_BYTES_PER_S  # weights + KV read once
        for mode in ("graphs", "eager") if graphs is not None else ("eager",):
            runner.graphs = graphs if mode == "graphs" else None
            before = runner.stats.graph_steps
            result = measure_direct(runner, sched, args.steps)
            assert (runner.stats.graph_steps > before) == (mode == "graphs")
            rows.append((batch, f"direct {mode}", result, floor_ms))
            if args.mixed_prompt:
                result = measure_direct(runner, sched, args.steps, args.mixed_prompt)
                rows.append((batch, f"direct {mode}, mixed +{args.mixed_prompt}", result, floor_ms))
        runner.graphs = graphs
        if args.service:
            result = measure_service(runner, batch, args.context, args.steps, max_tokens)
            rows.append((batch, "service " + ("graphs" if graphs else "eager"), result, floor_ms))

    def fmt(v, pct=False):
        return "n/a" if v is None else (f"{100 * v:.1f}%" if pct else f"{v:.2f}")

    print(f"\nllama-8b-shape, {args.layers} layers, bf16, context ~{args.context}, {args.steps} steps each")
    header = ["batch", "mode", "wall ms/step", "GPU busy ms/step", "GPU idle", "idle between"]
    header += ["floor ms", "tok/s"]
    cells = []
    for batch, mode, r, floor_ms in rows:
        times = [fmt(r["wall_ms"]), fmt(r["busy_ms"]), fmt(r["idle"], True), fmt(r["between_idle"], True)]
        cells.append([batch, mode, *times, f"{floor_ms:.2f}", f"{1000 * batch / r['wall_ms']:.0f}"])
    print(markdown_table(header, cells))


if __name__ == "__main__":
    main()
