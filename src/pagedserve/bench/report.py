"""The printed tables, the JSON result and the PNG plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedserve.bench.client import PassResult
from pagedserve.common.tables import render_table


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value:.1%}"


def _batch_context(floor: dict) -> str | None:
    return f"{floor['decode_batch']:.1f} x {floor['mean_context_tokens']:,.0f}" if floor else None


def _gb(floor: dict) -> str | None:
    if not floor:
        return None
    return f"{floor['weight_read_bytes'] / 1e9:.2f} + {floor['kv_read_bytes'] / 1e9:.2f}"


def _ratio(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def results_table(
    runs: Sequence[dict], comparison: dict | None = None, comparison_title: str = "prefix caching on vs off"
) -> str:
    """One column per pass; latency rows are mean / p50 / p90 / p99 in ms."""
    rows: list[list[str]] = []

    def add(name: str, values: Sequence) -> None:
        rows.append([name, *(_fmt(v) for v in values)])

    add("request rate (req/s)", [r["request_rate"] for r in runs])
    if any(r.get("max_concurrency") for r in runs):
        add("max concurrency", [r.get("max_concurrency") or "none" for r in runs])
    add("requests ok / failed", [f"{r['completed']} / {r['failed']}" for r in runs])
    add("duration (s)", [r["duration_s"] for r in runs])
    add("request throughput (req/s)", [r["request_throughput"] for r in runs])
    add("output throughput (tok/s)", [r["output_throughput"] for r in runs])
    add("total token throughput (tok/s)", [r["total_token_throughput"] for r in runs])
    add(
        "input / output tokens", [f"{r['total_input_tokens']:,} / {r['total_output_tokens']:,}" for r in runs]
    )
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        for stat in ("mean", "p50", "p90", "p99"):
            add(f"{name} {stat} (ms)", [r[key][stat] for r in runs])
    floors = [r.get("read_floor") or {} for r in runs]
    if any(floors):  # beside the per-token latencies: what a step must read, at copy speed
        add("decode batch (mean) x context", [_batch_context(f) for f in floors])
        add("weight + KV read per step (GB)", [_gb(f) for f in floors])
        add("read floor per step (ms)", [f.get("floor_ms") for f in floors])
        add("ITL p50 / floor", [_ratio(f.get("itl_p50_over_floor")) for f in floors])
        add("ITL p99 / floor", [_ratio(f.get("itl_p99_over_floor")) for f in floors])
        add("TPOT mean / floor", [_ratio(f.get("tpot_mean_over_floor")) for f in floors])
    servers = [r["server"] or {} for r in runs]
    add("preemptions", [s.get("preemptions") for s in servers])
    add(
        "peak KV blocks in use / total",
        [f"{s['peak_gpu_blocks_in_use']:,} / {s['num_gpu_blocks']:,}" if s else None for s in servers],
    )
    add("peak slot utilization", [_pct(s.get("peak_slot_utilization")) for s in servers])
    add("peak running requests (sampled)", [s.get("peak_running_requests") for s in servers])
    add("prompt tokens computed", [s.get("prompt_tokens_computed") for s in servers])
    add("prefix cache hit rate (hit/query)", [_pct(s.get("prefix_cache_hit_rate")) for s in servers])
    add("cached prompt tokens (usage)", [f"{r['cached_prompt_fraction']:.1%}" for r in runs])
    add("executor steps", [s.get("steps") for s in servers])
    add("executor steps per output token", [s.get("steps_per_output_token") for s in servers])
    add("output tok/s per request (decode, mean)", [r.get("output_tps_per_request") for r in runs])
    add("messages per output token (per request)", [r.get("messages_per_output_token") for r in runs])
    if any(s.get("spec_draft_tokens") for s in servers):  # speculative decoding
        rates = [_pct(s.get("spec_acceptance_rate")) for s in servers]
        add("spec acceptance rate (accepted/proposed)", rates)
        add("spec mean accepted length", [s.get("spec_mean_accepted_length") for s in servers])
    add("scheduler CPU per step (ms)", [s.get("scheduler_cpu_ms_per_step") for s in servers])
    text = render_table("pagedserve bench", ["metric", *(r["label"] for r in runs)], rows)
    for r in runs:
        for example in r["error_examples"]:
            text += f"\nfailed ({r['label']}): {example[:200]}"
        if (r["server"] or {}).get("counters_reset"):
            text += f"\nnote ({r['label']}): the executor was lost or replaced during the pass; "
            text += "the scheduler's counters restarted, so their deltas are n/a"
    if comparison:
        text += "\n\n" + render_table(
            comparison_title,
            ["metric", "value"],
            [[k, _fmt(v, 3)] for k, v in comparison.items()],
        )
    return text


def baseline_table(reference: dict, baselines: Sequence[dict], total_requests: int) -> str:
    header = ["system", "requests", "output tok/s", "total tok/s", "duration (s)", "padding waste", "ratio"]
    rows = [
        [
            "pagedserve",
            f"all {reference['num_requests']}",
            _fmt(reference["output_throughput"]),
            _fmt(reference["total_token_throughput"]),
            _fmt(reference["duration_s"]),
            "0.0%",
            "",
        ]
    ]
    for b in baselines:
        ratio = reference["output_throughput"] / b["output_throughput"] if b["output_throughput"] else None
        subset = "all" if b["num_requests"] == total_requests else "first"
        rows.append(
            [
                f"{b['system']} ({b['device']})",
                f"{subset} {b['num_requests']}",
                _fmt(b["output_throughput"]),
                _fmt(b["total_token_throughput"]),
                _fmt(b["duration_s"]),
                f"{b['padding_waste']:.1%}",
                f"{_fmt(ratio)}x" if ratio else "n/a",
            ]
        )
    note = "ratio = pagedserve output tok/s / baseline output tok/s (useful tokens only)"
    return render_table("baselines", header, rows) + "\n" + note


def write_plot(path: Path, runs: Sequence[dict], passes: Sequence[PassResult]) -> None:
    """Histograms of TTFT, ITL and E2E, and output tokens/s per 1 s bin, one colour per pass."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (
        (
            axes[0, 0],
            "TTFT (ms)",
            lambda p: [r.ttft * 1000 for r in p.records if r.ok and r.ttft is not None],
        ),
        (axes[0, 1], "ITL (ms)", lambda p: [x * 1000 for r in p.records if r.ok for x in r.itls()]),
        (axes[1, 0], "E2E latency (ms)", lambda p: [r.e2e * 1000 for r in p.records if r.ok]),
    )
    for ax, title, values in panels:
        data = [values(p) for p in passes]
        if not any(data):
            continue
        edges = np.histogram_bin_edges(np.concatenate([d for d in data if d]), bins=40)  # shared bins
        for run, d in zip(runs, data, strict=True):
            if d:
                ax.hist(d, bins=edges, alpha=0.5, label=run["label"])
        ax.set_title(title)
        ax.set_ylabel("count")
    ax = axes[1, 1]
    for run in runs:
        timeline = run["throughput_timeline"]
        if timeline:
            ax.stairs(timeline, np.arange(len(timeline) + 1), label=run["label"])
    ax.set_title("output throughput over time")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens/s (1 s bins)")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
