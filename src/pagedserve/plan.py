"""`pagedserve plan`: a deployment's KV-cache arithmetic, before it starts.

It answers what the seed's advice asks one to work out by hand: what the weights take, what the KV
cache costs per token (2 x layers x KV heads x head_dim x bytes: a 7B MHA model needs ~2 GiB for
one 4,096-token sequence and ~64 GiB for 32), how many blocks the pool gets at a given
`--gpu-memory-utilization`, how many sequences of the traffic's length fit, what the same model
would need with MHA, and what a contiguous max_model_len reservation per sequence (the way before
PagedAttention) would fit, with warnings from the seed's rules.

Everything comes from the executor's own code, fed the same flags (the executor's sizing flags,
under their own names): the model is built on the meta device (its parameters and its KV-cache
groups, no memory), the pool's block is `runner.kv_cache_layout`, the count is
`kv_cache.size_pools`. On the CPU that is the executor's count exactly. On CUDA the executor
subtracts a measured profile (`executor.profiling`) that `plan` estimates
(`executor.memory_estimate`); `--measure` loads the model as the executor does, on the GPU, and
prints the measured figures beside the estimate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.common.default_model import resolve_model

# The executor's flags that decide the pool (taken from executor.config.add_cli_args as they are).
SIZING_FLAGS = (
    "dtype",
    "device",
    "max_model_len",
    "block_size",
    "gpu_memory_utilization",
    "num_gpu_blocks_override",
    "swap_space",
    "cpu_kv_cache_space",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enforce_eager",
    "quantization",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "disable_hybrid_kv_cache_manager",
    "speculative_config",  # a draft model's weights and KV layers
)
# The seed's advice: validate --gpu-memory-utilization in this range on real traffic.
UTILIZATION_RANGE = (0.85, 0.92)
# Below this share of repeated prompt blocks, prefix caching has little to serve.
LOW_BLOCK_REUSE = 0.10
_GIB = 1 << 30


class PlanError(ValueError):
    """A plan that cannot be made (no GPU memory to plan for, a model we cannot run); one line."""


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / _GIB:,.2f} GiB"


def _bytes(value: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value} B"


@dataclass(frozen=True)
class KVGroupPlan:
    """One KV-cache group: its window, layers, and what its share of a token and of a block costs."""

    sliding_window: int | None
    num_layers: int
    bytes_per_token: int
    bytes_per_block: int


@dataclass(frozen=True)
class Fit:
    """A way of holding sequences of `context_len` tokens in the pool's memory."""

    bytes_per_sequence: int
    sequences: int  # how many fit


@dataclass
class PlanReport:
    """Everything `plan` prints; `--json` is `asdict` of it."""

    model: str
    architecture: str
    device: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    gpu_memory_bytes: int | None
    num_parameters: int  # of the whole model
    weight_bytes: int  # per rank
    kv_groups: list[KVGroupPlan]
    kv_bytes_per_token: int  # all groups, before any window is applied
    kv_bytes_per_block: int  # one block of one group
    memory_estimate: dict | None  # executor.memory_estimate's parts (CUDA only)
    num_gpu_blocks: int
    num_cpu_blocks: int
    pool_bytes: int
    sizing: str
    context_len: int
    concurrency: int
    blocks_per_sequence: int
    traffic_kv_bytes: int  # concurrency sequences of context_len
    paged: Fit
    running_at_once: int  # min(what fits, max_num_seqs)
    mha: Fit | None  # None: the model is MHA already
    mha_kv_bytes_per_token: int
    contiguous: Fit
    traffic: dict | None = None  # TrafficStats of --traffic
    warnings: list[str] = field(default_factory=list)
    measured: dict | None = None  # --measure


def build_parser() -> argparse.ArgumentParser:
    """`pagedserve plan`'s flags: its own, then the executor's sizing flags as the executor defines them."""
    from pagedserve.executor.config import add_cli_args

    p = argparse.ArgumentParser(
        prog="pagedserve plan",
        description="KV-cache memory of a deployment before it starts: weights, KV per token and block, "
        "the pool's blocks, how many sequences fit (paged, as MHA, contiguous), and warnings",
    )
    p.add_argument(
        "--model", type=resolve_model, default="",
        help="model directory or a bare config.json (default or empty: the built-in model)",
    )  # fmt: skip
    p.add_argument(
        "--gpu-memory", type=float, default=None, metavar="GIB",
        help="the GPU's memory in GiB (default: the visible GPU's total, as torch reports it)",
    )  # fmt: skip
    traffic = p.add_argument_group("traffic")
    traffic.add_argument(
        "--context-len", type=int, default=None,
        help="tokens per sequence, prompt + output (default: --traffic's p99, else max_model_len)",
    )  # fmt: skip
    traffic.add_argument(
        "--concurrency", type=int, default=None,
        help="sequences in flight at once (default: --traffic's peak, else 1)",
    )  # fmt: skip
    traffic.add_argument(
        "--traffic", type=Path, default=None, metavar="FILE",
        help="a scheduler's --request-log: its lengths, peak concurrency and prefix sharing",
    )  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument(
        "--measure", action="store_true",
        help="also load the model as the executor does (weights needed; on a GPU: profiling, pools, "
        "graphs) and print its real pool and measured memory beside the plan",
    )  # fmt: skip
    scratch = add_cli_args(argparse.ArgumentParser(add_help=False), endpoint=False)
    sizing = p.add_argument_group("executor sizing (the executor's flags)")
    for action in scratch._actions:
        if action.dest in SIZING_FLAGS:
            sizing._add_action(action)
    return p


def _model_dir(path: str, stack: list) -> Path:
    """The directory to read config.json from: `path`, or a temporary copy of a bare config file."""
    model = Path(path)
    if model.is_file():
        tmp = tempfile.TemporaryDirectory(prefix="pagedserve-plan-")
        stack.append(tmp)
        shutil.copyfile(model, Path(tmp.name) / "config.json")
        return Path(tmp.name)
    if not model.is_dir():
        raise PlanError(f"--model {path}: no such directory or config.json file")
    return model


def _gpu_total(args: argparse.Namespace, device: str) -> int | None:
    if device != "cuda" or args.num_gpu_blocks_override is not None and args.gpu_memory is None:
        return None
    if args.gpu_memory is not None:
        if not args.gpu_memory > 0:
            raise PlanError(f"--gpu-memory must be a positive number of GiB, got {args.gpu_memory}")
        return int(args.gpu_memory * _GIB)
    import torch

    if not torch.cuda.is_available():
        raise PlanError(
            "no GPU is visible to size the pool for: give --gpu-memory GIB (an H100 80GB reports "
            "79.2, an H200 139.8), or --device cpu to plan a CPU executor"
        )
    return torch.cuda.mem_get_info()[1]


def _plan_device(args: argparse.Namespace) -> str:
    """The device to size for: --device cpu plans a CPU executor; otherwise (auto, cuda) a GPU's
    pool, the visible GPU's or one of --gpu-memory GiB: a plan is mostly made for a GPU, often on a
    machine without one."""
    return "cpu" if args.device == "cpu" else "cuda"


def _meta_model(
    spec: Any, max_model_len: int, dtype: Any, quantization: str | None, tp: int, hybrid_kv_cache: bool = True
):
    """The executor's model (rank 0's shard under tensor parallelism) on the meta device: its
    parameters and KV-cache groups, without memory. The one place `plan` builds a model."""
    import torch

    from pagedserve.executor.model import CausalLM
    from pagedserve.executor.parallel import TPShard

    local = TPShard(0, tp).local_spec(spec) if tp > 1 else spec
    return CausalLM(
        local, max_model_len, torch.device("meta"), dtype, quantization, hybrid_kv_cache=hybrid_kv_cache
    )


def make_plan(args: argparse.Namespace, config: Any, spec: Any, traffic: Any = None) -> PlanReport:
    """The plan for parsed flags, the executor config they make and the model's spec."""
    import torch

    from pagedserve.common.kv_sizing import blocks_per_sequence
    from pagedserve.executor.kv_cache import KVCacheTooSmallError, check_fits, size_pools
    from pagedserve.executor.memory_estimate import CUDA_CONTEXT_BYTES, estimate_memory
    from pagedserve.executor.runner import kv_cache_layout, resolve_max_model_len

    device = _plan_device(args)
    total = _gpu_total(args, device)
    dtype = config.torch_dtype(torch.device(device))
    max_model_len = resolve_max_model_len(config, spec)
    tp = config.tensor_parallel_size
    hybrid = not config.disable_hybrid_kv_cache_manager
    model = _meta_model(spec, max_model_len, dtype, config.quantization, tp, hybrid)
    draft = None  # speculative decoding's draft model: its weights, and its layers in every block
    speculative = config.speculative_config
    if speculative is not None and speculative.method == "draft_model":
        from pagedserve.executor.loader import load_model_spec

        draft = _meta_model(load_model_spec(speculative.model), max_model_len, dtype, config.quantization, tp)
    layout = kv_cache_layout(config, model, draft)
    groups = model.kv_groups
    windows = groups.sliding_windows
    models = (model,) if draft is None else (model, draft)
    static = sum(t.numel() * t.element_size() for m in models for t in (*m.parameters(), *m.buffers()))
    weights = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
    estimate = None
    in_use = 0
    if device == "cuda" and config.num_gpu_blocks_override is None:
        estimate = estimate_memory(
            model.spec, config, max_model_len, static_bytes=static, element=dtype.itemsize,
            total_bytes=total, cuda_graphs=not config.enforce_eager,
        )  # fmt: skip
        in_use = CUDA_CONTEXT_BYTES
    sizing = size_pools(
        layout,
        config,
        max_model_len,
        device,
        windows,
        None if estimate is None else estimate.profile(),
        in_use,
    )
    per_block = layout.bytes_per_block
    block_size = config.block_size
    warnings: list[str] = []
    try:
        check_fits(
            layout, sizing.num_gpu_blocks, max_model_len, why=sizing.why, sliding_windows=windows,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )  # fmt: skip
    except KVCacheTooSmallError as exc:
        warnings.append(f"the executor would not start: {exc}")

    stats = traffic
    context_len = args.context_len or (stats.context_len_p99 if stats else max_model_len)
    concurrency = args.concurrency or (stats.peak_concurrency if stats else 1)
    chunk = config.max_num_batched_tokens
    per_seq_blocks = blocks_per_sequence(context_len, block_size, windows, chunk)
    pool_bytes = sizing.num_gpu_blocks * per_block
    paged = Fit(per_seq_blocks * per_block, sizing.num_gpu_blocks // per_seq_blocks)
    local = model.spec
    mha = None
    mha_per_token = per_block // block_size * len(windows) * local.num_heads // local.num_kv_heads
    if local.num_kv_heads != local.num_heads:
        mha_block = per_block * local.num_heads // local.num_kv_heads
        mha = Fit(per_seq_blocks * mha_block, pool_bytes // (per_seq_blocks * mha_block))
    # A contiguous cache reserves max_model_len positions per sequence (a window's for sliding layers).
    reserved = sum(min(max_model_len, w or max_model_len) for w in windows) * (per_block // block_size)
    contiguous = Fit(reserved, pool_bytes // reserved)
    report = PlanReport(
        model=spec.name,
        architecture=spec.architecture,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        quantization=config.quantization,
        kv_cache_dtype=str(layout.dtype).removeprefix("torch."),
        tensor_parallel_size=tp,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        gpu_memory_bytes=total,
        num_parameters=_num_parameters(spec, dtype, config.quantization, max_model_len, tp, model),
        weight_bytes=weights,
        kv_groups=_groups(groups, layout),
        kv_bytes_per_token=per_block // block_size * len(windows),
        kv_bytes_per_block=per_block,
        memory_estimate=None if estimate is None else _estimate_dict(estimate),
        num_gpu_blocks=sizing.num_gpu_blocks,
        num_cpu_blocks=sizing.num_cpu_blocks,
        pool_bytes=pool_bytes,
        sizing=sizing.why,
        context_len=context_len,
        concurrency=concurrency,
        blocks_per_sequence=per_seq_blocks,
        traffic_kv_bytes=concurrency * per_seq_blocks * per_block,
        paged=paged,
        running_at_once=min(paged.sequences, config.max_num_seqs),
        mha=mha,
        mha_kv_bytes_per_token=mha_per_token,
        contiguous=contiguous,
        traffic=None if stats is None else asdict(stats),
    )
    report.warnings = warnings + seed_warnings(report, estimate is not None, stats)
    return report


def _num_parameters(spec, dtype, quantization, max_model_len, tp, model) -> int:
    """Parameters of the whole model (under tensor parallelism `model` is one rank's shard)."""
    if tp == 1:
        return sum(p.numel() for p in model.parameters())
    whole = _meta_model(spec, max_model_len, dtype, quantization, 1)
    return sum(p.numel() for p in whole.parameters())


def _groups(groups: Any, layout: Any) -> list[KVGroupPlan]:
    counts = [0] * groups.num_groups
    for group in groups.layer_group:
        counts[group] += 1
    per_block = layout.bytes_per_block
    return [
        KVGroupPlan(window, count, per_block // layout.block_size, per_block)
        for window, count in zip(groups.sliding_windows, counts, strict=True)
    ]


def _estimate_dict(estimate: Any) -> dict:
    data = asdict(estimate)
    data["activation_peak_bytes"] = estimate.activation_peak_bytes
    data["graph_reserve_bytes"] = estimate.graph_reserve_bytes
    data["peak_bytes"] = estimate.profile().peak_bytes
    return data


def seed_warnings(report: PlanReport, sized_by_utilization: bool, stats: Any) -> list[str]:
    """The seed's rules, as warnings with the flag to change."""
    out = []
    lo, hi = UTILIZATION_RANGE
    u = report.gpu_memory_utilization
    if sized_by_utilization and not lo <= u <= hi:
        side = "below" if u < lo else "above"
        why = (
            "leaves memory unused that would hold more sequences"
            if u < lo
            else "leaves little headroom for activation spikes and fragmentation"
        )
        out.append(
            f"--gpu-memory-utilization {u:g} is {side} {lo}-{hi}: it {why}; validate the value on "
            "real traffic (pagedserve tune)"
        )
    if report.context_len > report.max_model_len:
        out.append(
            f"--context-len {report.context_len:,} is longer than max_model_len {report.max_model_len:,}: "
            "such requests are refused; raise --max-model-len (up to the model's limit)"
        )
    fit, want = report.paged.sequences, min(report.concurrency, report.max_num_seqs)
    if report.concurrency > fit:
        out.append(
            f"{report.concurrency} sequences of {report.context_len:,} tokens need "
            f"{_gib(report.traffic_kv_bytes)} of KV ({report.concurrency * report.blocks_per_sequence:,} "
            f"blocks); the pool holds {fit}: expect pre-emptions. Lower --max-num-seqs to {max(fit, 1)} "
            "or --max-model-len, or give the pool more memory (--gpu-memory-utilization, FP8 KV: "
            "--kv-cache-dtype fp8, tensor parallelism)"
        )
    elif want < report.concurrency:
        out.append(
            f"--max-num-seqs {report.max_num_seqs} runs fewer than the {report.concurrency} sequences in "
            f"flight; the pool holds {fit}: raise --max-num-seqs toward {fit} for throughput"
        )
    if stats is not None and stats.block_reuse < LOW_BLOCK_REUSE:
        out.append(
            f"only {stats.block_reuse:.1%} of the traffic's prompt blocks repeat an earlier request's: "
            "prefix caching only pays when prefixes repeat (--no-enable-prefix-caching costs nothing here)"
        )
    return out


def render(report: PlanReport) -> str:
    """The plan as text: one table of figures, then the warnings."""
    rows: list[list[str]] = []

    def add(name: str, value: str) -> None:
        rows.append([name, value])

    tp = report.tensor_parallel_size
    add("model", f"{report.model} ({report.architecture}), {report.num_parameters / 1e9:,.2f} B parameters")
    where = report.device + (f", {_gib(report.gpu_memory_bytes)}" if report.gpu_memory_bytes else "")
    add("device", where + (f", tensor parallel {tp} (figures per rank)" if tp > 1 else ""))
    add(
        "dtype / quantization / KV",
        f"{report.dtype} / {report.quantization or 'none'} / {report.kv_cache_dtype}",
    )
    add("weights", _gib(report.weight_bytes))
    add("KV per token", f"{_bytes(report.kv_bytes_per_token)} (all layers, K and V)")
    add("KV per block", f"{_bytes(report.kv_bytes_per_block)} ({report.block_size} tokens)")
    if len(report.kv_groups) > 1:
        for i, g in enumerate(report.kv_groups):
            kind = "full attention" if g.sliding_window is None else f"window {g.sliding_window:,}"
            add(f"  group {i}", f"{kind}, {g.num_layers} layers, {_bytes(g.bytes_per_token)} per token")
    estimate = report.memory_estimate
    if estimate is not None:
        add(
            "activation peak (estimated)",
            f"{_gib(estimate['activation_peak_bytes'])} ({estimate['step_tokens']:,} tokens, "
            f"{estimate['step_seqs']} sequences sampled)",
        )
        add(
            "CUDA graphs (estimated)",
            f"{_gib(estimate['graph_reserve_bytes'])} ({estimate['num_graphs']} graphs)",
        )
        add("outside torch (estimated)", _gib(estimate["non_torch_bytes"]))
    add("KV pool", f"{report.num_gpu_blocks:,} blocks = {_gib(report.pool_bytes)}")
    add("  sized by", report.sizing)
    add("swap pool (CPU)", f"{report.num_cpu_blocks:,} blocks")
    add(
        "traffic",
        f"{report.concurrency:,} x {report.context_len:,} tokens = {_gib(report.traffic_kv_bytes)} of KV",
    )
    add(
        "  sequences that fit",
        f"{report.paged.sequences:,} (paged, {report.blocks_per_sequence:,} blocks each)",
    )
    add(
        "  at most at once",
        f"{report.running_at_once:,} (what fits, capped by --max-num-seqs {report.max_num_seqs})",
    )
    if report.mha is None:
        add("  as MHA", "the model is MHA already")
    else:
        add(
            "  as MHA",
            f"{_bytes(report.mha_kv_bytes_per_token)} per token, "
            f"{_gib(report.concurrency * report.mha.bytes_per_sequence)} for the traffic, "
            f"{report.mha.sequences:,} fit",
        )
    add(
        "  contiguous max_model_len",
        f"{_gib(report.contiguous.bytes_per_sequence)} reserved per sequence, "
        f"{report.contiguous.sequences:,} fit",
    )
    if report.traffic:
        t = report.traffic
        add(
            "request log",
            f"{t['num_requests']:,} requests over {t['duration_s']:,.0f} s, peak {t['peak_concurrency']} "
            f"in flight, context p50/p99/max {t['context_len_p50']:,}/{t['context_len_p99']:,}/"
            f"{t['context_len_max']:,}, {t['block_reuse']:.1%} of prompt blocks repeat",
        )
    if report.measured:
        m = report.measured
        add("measured KV pool", f"{m['num_gpu_blocks']:,} blocks ({m['error']:+.2%} planned vs measured)")
        for key in ("peak_bytes", "graph_reserve_bytes", "non_torch_bytes"):
            if key not in m:  # measured on CUDA only
                continue
            add(
                f"  {key.removesuffix('_bytes')}, planned / measured",
                f"{_gib(m['planned_' + key])} / {_gib(m[key])}",
            )
    width = max(len(name) for name, _ in rows)
    text = "== pagedserve plan ==\n" + "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
    for warning in report.warnings:
        text += f"\nwarning: {warning}"
    return text


def measure(config: Any, report: PlanReport) -> dict:
    """Loads the model as the executor does (`ModelRunner.create`: on CUDA the profiling pass, the
    pools and the CUDA graphs) and returns its real pool beside the plan's figures, and on CUDA the
    measured profile beside the estimate."""
    from pagedserve.executor.runner import ModelRunner

    here = config.torch_device().type
    if report.device != here:
        raise PlanError(f"--measure runs the executor here, on {here}: plan for it with --device {here}")
    if config.tensor_parallel_size != 1:
        raise PlanError("--measure loads one executor on one GPU: give --tensor-parallel-size 1")
    runner = ModelRunner.create(config)
    measured = runner.kv_cache.num_device_blocks
    memory = runner.memory_profile
    estimate = report.memory_estimate or {}
    out = {
        "num_gpu_blocks": measured,
        "planned_num_gpu_blocks": report.num_gpu_blocks,
        "error": (report.num_gpu_blocks - measured) / measured if measured else 0.0,
    }
    if memory is not None:
        out.update(dataclasses.asdict(memory))
        for key in ("peak_bytes", "graph_reserve_bytes", "non_torch_bytes"):
            out[f"planned_{key}"] = estimate.get(key)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from pagedserve.bench.replay import traffic_stats
    from pagedserve.common.logs import configure_logging
    from pagedserve.common.request_log import RequestLogError, read_request_log
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.loader import UnsupportedModelError, load_model_spec

    for flag in ("context_len", "concurrency"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    configure_logging("plan")  # the loader's and the executor's (--measure) log lines to stderr, not stdout
    stack: list = []
    try:
        model_dir = _model_dir(args.model, stack)
        config = ExecutorConfig.from_args(args, parser=parser, model=str(model_dir))
        spec = load_model_spec(model_dir)
        if Path(args.model).is_file():
            spec = dataclasses.replace(spec, name=Path(args.model).stem)
        stats = traffic_stats(read_request_log(args.traffic)) if args.traffic else None
        report = make_plan(args, config, spec, stats)
        if args.measure:
            report.measured = measure(config, report)
    except (PlanError, RequestLogError, UnsupportedModelError, FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    finally:
        for tmp in stack:
            tmp.cleanup()
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
