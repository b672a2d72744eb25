"""Benchmark of the fused-MoE Triton kernels (`kernels.triton_moe`) on Qwen3-30B-A3B's layer shapes
(run on a GPU): 128 experts, top-8, hidden 2048, expert width 768.

    python -m benchmarks.moe [--result-file bench-results/moe.json] [--tokens 64,512,8192] [--quick]
                             [--sweep [--sweep-budget-s 240] [--sweep-gemms gate_up,down]]
                             [--ab [--baseline PATH] [--ab-rounds 7]]

For each number of tokens and each mode (bf16 weights; FP8 weights widened to bf16; FP8 weights
with FP8 activations per token), with random routing (softmax over random logits, top-8):
1. Correctness: against `kernels.reference.fused_moe` (fp32), max abs error printed and checked.
2. Timing, median of `triton.testing.do_bench` (L2 flushed before each repetition), eager and as a
   replay of a CUDA graph holding the call (as the executor's decode steps run), against two
   anchors measured in the same run:
   (a) dense: a bf16 `torch.matmul` of the same FLOPs, M = tokens * top_k rows through one
       [hidden -> 2 * 768] and one [768 -> hidden] weight (what the grouped GEMMs would cost if
       routing were free and every row went to one expert);
   (b) loop: a per-expert loop in torch (gather the expert's tokens, gate_up matmul, SiLU-and-mul,
       down matmul, weighted index_add; bf16 weights in every mode).
   TFLOP/s counts 6 * tokens * top_k * hidden * 768; the weight bytes/s counts the weights of the
   experts that got a token (at decode sizes the kernel is bound by reading them).
   The goal: >= 0.7x the dense anchor's TFLOP/s at 8,192 tokens (graph times for both).
3. Where the time goes: the GPU time of each stage of one call from the profiler's kernel records
   (align: the three sorting kernels; gate_up; down; combine: the top-k sum; quantize: FP8
   activations), their launches, and the graph time they leave unexplained (gaps between
   kernels).
4. `--quick`: fewer repetitions and no per-expert loop (a quick check of a change).
5. `--sweep` also times other tile configs (`kernels.triton_moe.MoeConfig`) for each GEMM, the
   other GEMM keeping its default, and prints the best per case next to the default
   (`--sweep-budget-s` bounds it; settings left out are reported; `--sweep-gemms` picks the GEMMs).

6. `--ab`: the layer (bf16, `--tokens`, default 8,192) as a replayed graph for several variants in
   one process, interleaved over `--ab-rounds` rounds (each round times every variant once, in a
   rotated order, so that clock and thermal drift fall on all alike): the dense anchor, a baseline
   module (`--baseline PATH`, e.g. main's `kernels/triton_moe.py` from before a change, loaded
   under its own name) with its own defaults, and `AB_VARIANTS` of this tree's kernels. Prints the
   median and range per variant, the ratio to the dense anchor (median of the per-round ratios),
   the gain against the baseline, each one's stage breakdown, and the fastest variant with the
   `choose_config` line that makes it the default.

A line per case shows progress; a markdown table comes last; the JSON holds everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from benchmarks.kernels import as_graph
from pagedserve.kernels import fp8, reference
from pagedserve.kernels import triton_moe as tm

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
DTYPE = torch.bfloat16
TOKENS = (64, 512, 8192)
MODES = ("bf16", "fp8-widened", "fp8-activations")
DENSE_GOAL = {8192: 0.7}
TOLERANCE = 2e-2  # of the output's largest magnitude (bf16 modes)
FP8_ACT_TOLERANCE = 0.1  # the activations' own quantization error
# Stages of one call by kernel name (profiler records); anything else is "other".
STAGES = (
    ("align", "_align_"),
    ("gate_up", "_gate_up_kernel"),
    ("down", "_down_kernel"),
    ("quantize", "_quant_kernel"),
    ("combine", "_sum_top_k_kernel"),
)
BREAKDOWN_CALLS = 20
# --sweep candidates (block_m, block_n, block_k, group_m, warps, stages, tma_weights); gate_up's
# block_n is per half (its program holds a gate and an up accumulator).
GATE_UP_SWEEP = [
    tm.MoeConfig(16, 64, 128, 1, 4, 3),
    tm.MoeConfig(16, 128, 128, 1, 4, 3),
    tm.MoeConfig(16, 128, 128, 1, 8, 4),
    tm.MoeConfig(16, 64, 256, 1, 4, 2),
    tm.MoeConfig(32, 64, 128, 1, 4, 3),
    tm.MoeConfig(64, 64, 64, 1, 4, 3),
    tm.MoeConfig(64, 64, 64, 8, 4, 4),
    tm.MoeConfig(64, 128, 64, 8, 8, 3),
    tm.MoeConfig(128, 64, 64, 8, 4, 3),
    tm.MoeConfig(128, 64, 64, 8, 8, 4),
    tm.MoeConfig(128, 128, 64, 8, 8, 3),
    tm.MoeConfig(128, 128, 64, 16, 8, 4),
    tm.MoeConfig(128, 64, 128, 8, 8, 3),
    tm.MoeConfig(128, 64, 64, 16, 8, 4),
    tm.MoeConfig(128, 64, 64, 8, 8, 5),
    tm.MoeConfig(128, 128, 32, 8, 8, 4),
    tm.MoeConfig(128, 128, 64, 4, 8, 3),
    # weight tiles through TMA descriptors
    tm.MoeConfig(16, 128, 128, 1, 4, 3, tma_weights=True),
    tm.MoeConfig(64, 64, 64, 1, 4, 3, tma_weights=True),
    tm.MoeConfig(128, 128, 64, 8, 8, 3, tma_weights=True),
    tm.MoeConfig(128, 128, 64, 8, 8, 4, tma_weights=True),
    tm.MoeConfig(128, 64, 64, 8, 8, 4, tma_weights=True),
    tm.MoeConfig(128, 64, 128, 8, 8, 3, tma_weights=True),
]
DOWN_SWEEP = [
    tm.MoeConfig(16, 128, 128, 1, 4, 3),
    tm.MoeConfig(16, 256, 128, 1, 8, 3),
    tm.MoeConfig(16, 64, 128, 1, 4, 4),
    tm.MoeConfig(32, 128, 128, 1, 4, 3),
    tm.MoeConfig(64, 128, 64, 1, 4, 3),
    tm.MoeConfig(64, 128, 64, 8, 4, 4),
    tm.MoeConfig(64, 256, 64, 8, 8, 4),
    tm.MoeConfig(128, 128, 64, 8, 8, 3),
    tm.MoeConfig(128, 256, 64, 8, 8, 4),
    tm.MoeConfig(128, 128, 128, 8, 8, 3),
    tm.MoeConfig(128, 256, 64, 8, 8, 3),
    tm.MoeConfig(128, 128, 64, 16, 8, 4),
    tm.MoeConfig(128, 128, 64, 8, 4, 3),
    tm.MoeConfig(128, 64, 128, 8, 4, 4),
    # weight tiles through TMA descriptors
    tm.MoeConfig(16, 256, 128, 1, 8, 3, tma_weights=True),
    tm.MoeConfig(64, 128, 64, 1, 4, 3, tma_weights=True),
    tm.MoeConfig(128, 128, 64, 8, 8, 3, tma_weights=True),
    tm.MoeConfig(128, 256, 64, 8, 8, 3, tma_weights=True),
    tm.MoeConfig(128, 128, 128, 8, 8, 3, tma_weights=True),
]


# --ab variants of this tree's kernels: name -> (gate_up, down) changes to the prefill defaults
# (`dataclasses.replace` keywords; None keeps a GEMM's default). The persistent and flattened
# launches compile for sm_90 with triton 3.6 without spills (gate_up 250/255 registers, down
# 236/229; checked on the CPU); their speed is what the A/B decides. gate_up as one product
# (one_dot), compiled for sm_90 on the CPU with triton 3.7.1: 255 registers and 84 bytes spilled at
# 128 columns a half (the two products: 108 bytes), no spill at 64.
AB_VARIANTS: dict[str, tuple[dict | None, dict | None]] = {
    "defaults": (None, None),
    "down one program per tile": (None, dict(persistent=False, flatten=False)),
    "gate_up one product": (dict(one_dot=True), None),
    "gate_up one product, 3 stages": (dict(one_dot=True, num_stages=3), None),
    "gate_up one product, 64 columns a half": (dict(one_dot=True, block_n=64), None),
}
AB_ROUNDS = 7


def log(msg: str) -> None:
    print(msg, flush=True)


def bench(fn: Callable[[], object], quick: bool = False) -> float:
    """Median time in us; do_bench clears L2 before each repetition."""
    warmup, rep = (5, 25) if quick else (25, 100)
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def flops(tokens: int) -> float:
    return 6.0 * tokens * TOP_K * HIDDEN * INTER


class Layer:
    """One MoE layer's weights (bf16, and the same quantized to FP8 per output row)."""

    def __init__(self, device: torch.device) -> None:
        self.w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device=device) * HIDDEN**-0.5).to(DTYPE)
        self.w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device=device) * INTER**-0.5).to(DTYPE)
        q13, s13 = fp8.quantize_weight(self.w13.flatten(0, 1))
        q2, s2 = fp8.quantize_weight(self.w2.flatten(0, 1))
        self.w13_fp8, self.w13_scale = q13.view(self.w13.shape), s13.view(NUM_EXPERTS, -1).float()
        self.w2_fp8, self.w2_scale = q2.view(self.w2.shape), s2.view(NUM_EXPERTS, -1).float()

    def args(self, mode: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> dict:
        if mode == "bf16":
            return dict(x=x, w13=self.w13, w2=self.w2, topk_weights=weights, topk_ids=ids)
        return dict(
            x=x, w13=self.w13_fp8, w2=self.w2_fp8, topk_weights=weights, topk_ids=ids,
            w13_scale=self.w13_scale, w2_scale=self.w2_scale,
        )  # fmt: skip

    def expert_bytes(self, mode: str) -> int:
        element = 2 if mode == "bf16" else 1
        return 3 * INTER * HIDDEN * element


def routing(tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, NUM_EXPERTS, device=device)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def expert_loop(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Anchor (b): the routed experts one at a time in torch, in x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1)
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    for expert in range(w13.shape[0]):
        rows = (flat_ids == expert).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        tokens = token_of[rows]
        gate_up = x[tokens] @ w13[expert].T
        hidden = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
        out.index_add_(0, tokens, (hidden @ w2[expert].T).float() * flat_weights[rows, None])
    return out.to(x.dtype)


def dense_anchor(tokens: int, device: torch.device) -> Callable[[], object]:
    """Anchor (a): the same FLOPs as one dense bf16 GEMM pair, M = tokens * top_k."""
    rows = tokens * TOP_K
    a = torch.randn(rows, HIDDEN, device=device, dtype=DTYPE)
    w1 = torch.randn(HIDDEN, 2 * INTER, device=device, dtype=DTYPE)
    h = torch.randn(rows, INTER, device=device, dtype=DTYPE)
    w2 = torch.randn(INTER, HIDDEN, device=device, dtype=DTYPE)
    out1 = torch.empty(rows, 2 * INTER, device=device, dtype=DTYPE)
    out2 = torch.empty(rows, HIDDEN, device=device, dtype=DTYPE)

    def run() -> None:
        torch.matmul(a, w1, out=out1)
        torch.matmul(h, w2, out=out2)

    return run


def check(mode: str, out: torch.Tensor, args: dict) -> tuple[float, bool]:
    expected = reference.fused_moe(**args).float()
    err = (out.float() - expected).abs().max().item()
    tol = FP8_ACT_TOLERANCE if mode == "fp8-activations" else TOLERANCE
    return err, err <= tol * expected.abs().max().item() and not out.isnan().any().item()


def breakdown(fn: Callable[[], object]) -> dict:
    """GPU time (us per call) and launches per stage (`STAGES`) of BREAKDOWN_CALLS eager calls, from
    the profiler's kernel records (kernel durations, as a graph replays them)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(BREAKDOWN_CALLS):
            fn()
        torch.cuda.synchronize()
    stages: dict = {name: {"us": 0.0, "launches": 0} for name, _ in STAGES + (("other", ""),)}
    others: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:  # older torch
            us = event.self_cuda_time_total
        if us <= 0:
            continue
        stage = next((name for name, part in STAGES if part in event.key), "other")
        stages[stage]["us"] += us / BREAKDOWN_CALLS
        stages[stage]["launches"] += event.count / BREAKDOWN_CALLS
        if stage == "other":
            others[event.key[:60]] = others.get(event.key[:60], 0.0) + us / BREAKDOWN_CALLS
    stages["other"]["kernels"] = dict(sorted(others.items(), key=lambda kv: -kv[1])[:4])
    return stages


def breakdown_line(stages: dict, graph_us: float) -> str:
    kernels = sum(v["us"] for v in stages.values())
    parts = [
        f"{name} {v['us']:.1f} ({v['launches']:g})" for name, v in stages.items() if v["launches"] or v["us"]
    ]
    other = "".join(f"\n   other: {us:7.1f} us {name}" for name, us in stages["other"]["kernels"].items())
    return (
        f"   stages us (launches): {', '.join(parts)} | kernels {kernels:.1f} of graph {graph_us:.1f} "
        f"({graph_us - kernels:+.1f} between kernels){other}"
    )


def run_case(
    layer: Layer, tokens: int, mode: str, sweep_deadline: float | None, quick: bool, gemms: list[str]
) -> dict:
    device = layer.w13.device
    x = torch.randn(tokens, HIDDEN, device=device, dtype=DTYPE)
    weights, ids = routing(tokens, device)
    args = layer.args(mode, x, weights, ids)
    options = dict(fp8_activations=mode == "fp8-activations")
    ours_fn = functools.partial(tm.fused_moe, **args, **options)
    err, ok = check(mode, ours_fn(), args)
    ours = bench(ours_fn, quick)
    ours_graph = bench(as_graph(ours_fn), quick)
    dense_fn = dense_anchor(tokens, device)
    dense, dense_graph = bench(dense_fn, quick), bench(as_graph(dense_fn), quick)
    loop = None
    if not quick:
        loop = bench(functools.partial(expert_loop, x, layer.w13, layer.w2, weights, ids), quick=True)
    stages = breakdown(ours_fn)
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * layer.expert_bytes(mode)
    rows = tokens * TOP_K
    row = {
        "tokens": tokens,
        "mode": mode,
        "max_abs_err": err,
        "ok": ok,
        "ours_us": ours,
        "ours_graph_us": ours_graph,
        "ours_tflops": flops(tokens) / ours_graph / 1e6,
        "dense_us": dense,
        "dense_graph_us": dense_graph,
        "dense_tflops": flops(tokens) / dense_graph / 1e6,
        "vs_dense": dense_graph / ours_graph,
        "loop_us": loop,
        "vs_loop": None if loop is None else loop / ours_graph,
        "stages": stages,
        "experts_touched": touched,
        "weight_tbps": weight_bytes / ours_graph / 1e6,
        "goal_vs_dense": DENSE_GOAL.get(tokens),
        **{f"{which}_config": asdict(config) for which, config in default_configs(rows, mode).items()},
    }
    loop_part = "" if loop is None else f" | loop {loop:9.1f} us x{row['vs_loop']:.1f}"
    log(
        f"moe T={tokens:<5} {mode:<16} ours {ours:8.1f} us (graph {ours_graph:8.1f}) "
        f"{row['ours_tflops']:6.1f} TFLOP/s {row['weight_tbps']:4.2f} TB/s of weights | dense "
        f"{dense_graph:8.1f} us {row['dense_tflops']:6.1f} TFLOP/s x{row['vs_dense']:.2f}{loop_part} | "
        f"err {err:.1e} {'ok' if ok else 'FAIL'}"
    )
    log(breakdown_line(stages, ours_graph))
    if sweep_deadline is not None:
        row["sweep"] = sweep(args, options, default_configs(rows, mode), ours_graph, sweep_deadline, gemms)
    return row


def default_configs(rows: int, mode: str) -> dict[str, tm.MoeConfig]:
    """`fused_moe`'s own tile choices for this mode."""
    w_fp8, a_fp8 = mode != "bf16", mode == "fp8-activations"
    return {
        "gate_up": tm.choose_config(rows, NUM_EXPERTS, INTER, HIDDEN, True, w_fp8, a_fp8),
        "down": tm.choose_config(rows, NUM_EXPERTS, HIDDEN, INTER, False, w_fp8, a_fp8),
    }


def sweep(
    args: dict, options: dict, defaults: dict, default_us: float, deadline: float, gemms: list[str]
) -> dict:
    """Each GEMM's candidates with the other's default config (graph replays of the whole call)."""
    found: dict = {which: [] for which in gemms}
    for which, candidates in (("gate_up", GATE_UP_SWEEP), ("down", DOWN_SWEEP)):
        if which not in gemms:
            continue
        for config in candidates:
            if time.time() > deadline:
                found[which].append({"config": asdict(config), "skipped": "sweep budget spent"})
                continue
            configs = {f"{k}_config": v for k, v in {**defaults, which: config}.items()}
            fn = functools.partial(tm.fused_moe, **args, **options, **configs)
            try:
                us = bench(as_graph(fn), quick=True)
            except Exception as exc:  # a config that does not compile or fit is skipped
                found[which].append({"config": asdict(config), "error": repr(exc)[:200]})
                continue
            found[which].append({"config": asdict(config), "us": us})
        timed = sorted((f for f in found[which] if "us" in f), key=lambda f: f["us"])
        for f in timed[:3]:
            log(
                f"   sweep {which:<7}: {tuple(f['config'].values())} {f['us']:8.1f} us "
                f"(default {tuple(asdict(defaults[which]).values())} {default_us:8.1f} us)"
            )
        skipped = sum("skipped" in f for f in found[which])
        if skipped:
            log(f"   sweep {which}: {skipped} settings left out (budget)")
    return found


def load_baseline(path: str):
    """A copy of `kernels/triton_moe.py` (another revision) as its own module."""
    spec = importlib.util.spec_from_file_location("triton_moe_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def ab_variants(rows: int) -> dict[str, dict]:
    """`AB_VARIANTS` as fused_moe keyword arguments (gate_up_config / down_config)."""
    defaults = default_configs(rows, "bf16")
    out = {}
    for name, changes in AB_VARIANTS.items():
        configs = {}
        for which, change in zip(("gate_up", "down"), changes, strict=True):
            configs[f"{which}_config"] = dataclasses.replace(defaults[which], **(change or {}))
        out[name] = configs
    return out


def ab(layer: Layer, tokens: int, baseline_path: str | None, rounds: int) -> dict:
    """The --ab comparison (module docstring, 6.)."""
    device = layer.w13.device
    x = torch.randn(tokens, HIDDEN, device=device, dtype=DTYPE)
    weights, ids = routing(tokens, device)
    args = layer.args("bf16", x, weights, ids)
    fns: dict[str, Callable[[], object]] = {"dense bf16 (cuBLAS)": dense_anchor(tokens, device)}
    checks: dict[str, tuple[float, bool]] = {}
    if baseline_path:
        fns["baseline"] = functools.partial(load_baseline(baseline_path).fused_moe, **args)
    variants = ab_variants(tokens * TOP_K)
    for name, configs in variants.items():
        fns[name] = functools.partial(tm.fused_moe, **args, **configs)
    graphs = {}
    for name, fn in fns.items():
        start = time.time()
        try:
            if not name.startswith("dense"):
                checks[name] = check("bf16", fn(), args)
            graphs[name] = as_graph(fn)
        except Exception as exc:  # a variant that does not compile or fit is reported, not fatal
            log(f"ab {name}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        err = checks.get(name, (0.0,))[0]
        log(f"ab {name}: compiled and captured in {time.time() - start:.0f} s, err {err:.1e}")
    names = list(graphs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(bench(graphs[name], quick=True))
    dense = times[names[0]]
    rows = []
    for name in names:
        us = times[name]
        ratio = statistics.median(d / t for d, t in zip(dense, us, strict=True))
        rows.append(dict(name=name, median_us=statistics.median(us), min_us=min(us), max_us=max(us),
                         vs_dense=ratio, ok=checks.get(name, (0.0, True))[1]))  # fmt: skip
    base = next((r["median_us"] for r in rows if r["name"] == "baseline"), None)
    log("")
    log(f"| variant ({tokens} tokens, bf16, graph replays) | median us | range us | TFLOP/s | x dense | "
        "vs baseline | ok |")  # fmt: skip
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        gain = "-" if base is None or r["name"].startswith("dense") else f"{base - r['median_us']:+.1f} us"
        log(f"| {r['name']} | {r['median_us']:.1f} | {r['min_us']:.1f}-{r['max_us']:.1f} | "
            f"{flops(tokens) / r['median_us'] / 1e6:.1f} | {r['vs_dense']:.3f} | {gain} | "
            f"{'yes' if r['ok'] else 'NO'} |")  # fmt: skip
    log(f"{rounds} rounds, each timing every variant once (do_bench, quick); x dense: median of the "
        f"per-round ratios; goal x dense >= {DENSE_GOAL.get(tokens, '-')}.")  # fmt: skip
    log("")
    stages = {}
    for name in names[1:]:
        stages[name] = breakdown(fns[name])
        log(f"{name}:")
        log(breakdown_line(stages[name], statistics.median(times[name])))
    ours = [r for r in rows if r["name"] in variants and r["ok"]]
    best = min(ours, key=lambda r: r["median_us"]) if ours else None
    if best is not None:
        configs = variants[best["name"]]
        log("")
        log(f"fastest of this tree's variants: {best['name']} ({best['median_us']:.1f} us, "
            f"x{best['vs_dense']:.3f} of dense). As the bf16 prefill default, in choose_config:")  # fmt: skip
        for which in ("gate_up", "down"):
            log(f"  {which}: {configs[f'{which}_config']}")
    return dict(tokens=tokens, rounds=rounds, times_us=times, rows=rows, stages=stages,
                best=None if best is None else best["name"])  # fmt: skip


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: dict) -> None:
    log("")
    log(
        "| tokens | mode | ours us (eager / graph) | ours TFLOP/s | weights TB/s | dense bf16 us | "
        "dense TFLOP/s | ours / dense | per-expert loop us | loop / ours | goal | ok |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["cases"]:
        goal = r["goal_vs_dense"]
        met = "-" if goal is None else (f">= {goal}: " + ("yes" if r["vs_dense"] >= goal else "NO"))
        log(
            f"| {r['tokens']} | {r['mode']} | {r['ours_us']:.1f} / {r['ours_graph_us']:.1f} | "
            f"{r['ours_tflops']:.1f} | {r['weight_tbps']:.2f} | {r['dense_graph_us']:.1f} | "
            f"{r['dense_tflops']:.1f} | {r['vs_dense']:.2f} | {fmt(r['loop_us'], '.0f')} | "
            f"{fmt(r['vs_loop'], '.1f')} | "
            f"{met} | {'yes' if r['ok'] else 'NO'} |"
        )
    log(
        f"Qwen3-30B-A3B layer: {NUM_EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, width {INTER}; "
        "TFLOP/s = 6 * tokens * top_k * hidden * width / graph time (both columns); weights TB/s: "
        "bytes of the experts that got a token / graph time. dense: bf16 torch.matmul with "
        "M = tokens * top_k of the same FLOPs; loop: a per-expert loop in torch (bf16)."
    )
    log("")
    log("| tokens | mode | align | gate_up | down | quantize | combine | other | kernels / graph us |")
    log("|---|---|---|---|---|---|---|---|---|")
    for r in results["cases"]:
        st = r["stages"]
        cells = " | ".join(f"{st[name]['us']:.1f} ({st[name]['launches']:g})" for name in
                           ("align", "gate_up", "down", "quantize", "combine", "other"))  # fmt: skip
        kernels = sum(v["us"] for v in st.values())
        log(f"| {r['tokens']} | {r['mode']} | {cells} | {kernels:.1f} / {r['ours_graph_us']:.1f} |")
    log("stages: GPU us per call (launches per call) from the profiler, eager calls.")
    log(f"correctness: {'all ok' if results['correct'] else 'FAILURES'}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--result-file", default="bench-results/moe.json")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no per-expert loop")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs")
    parser.add_argument("--sweep-budget-s", type=float, default=240.0, help="seconds the sweep may take")
    parser.add_argument("--sweep-gemms", default="gate_up,down", help="the GEMMs to sweep, comma-separated")
    parser.add_argument("--ab", action="store_true", help="interleaved A/B of AB_VARIANTS (bf16, one size)")
    parser.add_argument("--baseline", help="--ab: a kernels/triton_moe.py of another revision to time too")
    parser.add_argument("--ab-rounds", type=int, default=AB_ROUNDS, help="--ab: rounds of timings")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA device"
    device = torch.device("cuda")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    results: dict = {
        "device": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": dict(num_experts=NUM_EXPERTS, top_k=TOP_K, hidden=HIDDEN, inter=INTER),
        "fp8_activations_min_rows": tm.FP8_ACTIVATIONS_MIN_ROWS,
        "cases": [],
    }
    log(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}")
    start = time.time()
    layer = Layer(device)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.ab:
        results["ab"] = ab(layer, tokens[-1], args.baseline, args.ab_rounds)  # the largest by default
        results["wall_s"] = time.time() - start
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
        log(f"wrote {path} ({results['wall_s']:.0f} s)")
        return
    modes = args.modes.split(",")
    cases = [(t, m) for t in tokens for m in modes]
    for index, (t, mode) in enumerate(cases):
        deadline = None
        if args.sweep:
            deadline = time.time() + (start + args.sweep_budget_s - time.time()) / (len(cases) - index)
        results["cases"].append(run_case(layer, t, mode, deadline, args.quick, args.sweep_gemms.split(",")))
        torch.cuda.empty_cache()
    results["correct"] = all(r["ok"] for r in results["cases"])
    results["wall_s"] = time.time() - start
    path = Path(args.result_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print_table(results)
    log(f"wrote {path} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
