"""`pagedserve tune`'s runs and its choice: one measured pass per grid point, the recommendation with
its reasons, the table and the plot (the command line is pagedserve.tune)."""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedserve.bench.client import PassResult, SendOptions, get_model_info, run_pass, warmup_requests
from pagedserve.bench.launch import LaunchError, launched_executors
from pagedserve.bench.metrics import summarize
from pagedserve.common.tables import render_table

# Pre-emptions per 100 requests above which a point counts as pre-empting often.
FREQUENT_PREEMPTIONS = 5.0
# Peak KV use below which a point had memory to spare.
HEADROOM = 0.8
# Points whose objective is within this fraction of the best are tied (see `recommend`).
TIE = 0.03
# A prefix-cache hit rate below which caching has little to serve.
LOW_HIT_RATE = 0.10


@dataclass
class PointResult:
    """One grid point's pass (or why it has none)."""

    index: int
    point: Any  # pagedserve.tune.GridPoint
    summary: dict | None = None  # bench.metrics.summarize of the pass
    goodput: float | None = None  # requests/s that met every SLO given
    error: str | None = None
    fidelity: dict | None = None  # the replay against the log it replays (--traffic)
    meets_slo: bool = False
    slo_violation: float = 0.0  # the worst ratio of a p99 to its bound (<= 1: met)

    def metric(self, *path: str) -> float | None:
        value: Any = self.summary
        for key in path:
            if value is None:
                return None
            value = value.get(key)
        return value

    @property
    def ok(self) -> bool:
        return self.summary is not None and self.summary["failed"] == 0

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "label": self.point.label(),
            "settings": asdict(self.point),
            "executor_flags": self.point.executor_flags(),
            "scheduler_flags": self.point.scheduler_flags(),
            "error": self.error,
            "goodput_req_s": self.goodput,
            "meets_slo": self.meets_slo,
            "replay_fidelity": self.fidelity,
            "summary": self.summary,
        }


def _goodput(result: PassResult, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> float:
    """Requests per second that met every SLO given: TTFT <= the TTFT bound, and their own mean
    inter-token latency (TPOT) <= the ITL bound."""
    good = 0
    for r in result.records:
        if not r.ok or r.ttft is None:
            continue
        if slo_ttft_ms is not None and r.ttft * 1000 > slo_ttft_ms:
            continue
        if slo_itl_ms is not None and r.tpot is not None and r.tpot * 1000 > slo_itl_ms:
            continue
        good += 1
    return good / max(result.end - result.start, 1e-9)


def _judge(result: PointResult, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> None:
    ratios = []
    if slo_ttft_ms is not None:
        ratios.append((result.metric("ttft_ms", "p99") or float("inf")) / slo_ttft_ms)
    if slo_itl_ms is not None:
        ratios.append((result.metric("itl_ms", "p99") or 0.0) / slo_itl_ms)
    result.slo_violation = max(ratios, default=0.0)
    result.meets_slo = result.ok and result.slo_violation <= 1.0


def _replayed_records(path: Path, label: str) -> dict[int, Any]:
    """The pass's requests in a point's request log, by index (warmups left out)."""
    from pagedserve.common.request_log import RequestLogError, read_request_log

    prefix = f"bench-{label}-"
    try:
        records = read_request_log(path)
    except RequestLogError:
        return {}
    return {int(r.request_id[len(prefix) :]): r for r in records if r.request_id.startswith(prefix)}


def run_grid(
    args: argparse.Namespace, base: Any, points: Sequence[Any], traffic: Any, log_dir: Path
) -> list[PointResult]:
    """Every point's pass, executors launched once per executor setting (see pagedserve.tune)."""
    from tqdm import tqdm

    from pagedserve.bench.replay import replay_fidelity

    options = SendOptions(0.0, True, args.seed, None, args.request_timeout)
    requests = arrivals = None
    results = [PointResult(i, p) for i, p in enumerate(points)]
    executor_args, scheduler_args = shlex.split(args.executor_args), shlex.split(args.scheduler_args)
    groups = itertools.groupby(results, key=lambda r: r.point.executor_key())
    bar = tqdm(total=len(points), desc="tune: grid points", unit="point", file=sys.stderr)
    for k, (_, group) in enumerate(groups):
        group = list(group)
        first = group[0].point
        try:
            with launched_executors(
                args.model, log_dir / f"executors-{k}", [*executor_args, *first.executor_flags()],
                args.launch_timeout, device=base.device, gpu_memory_utilization=first.gpu_memory_utilization,
                tensor_parallel_size=base.tensor_parallel_size,
            ) as executors:  # fmt: skip
                for result in group:
                    point_dir = log_dir / f"point-{result.index}"
                    request_log = point_dir / "requests.jsonl"
                    request_log.unlink(missing_ok=True)
                    sched = [
                        *scheduler_args,
                        *result.point.scheduler_flags(),
                        "--request-log",
                        str(request_log),
                    ]
                    try:
                        with executors.scheduler(sched, point_dir) as address:
                            info = get_model_info(address)
                            if requests is None:
                                requests, arrivals = traffic.requests_and_arrivals(
                                    info.vocab_size, info.max_model_len or None
                                )
                            if args.num_warmups:
                                warmup = warmup_requests(
                                    args.num_warmups, info.vocab_size, info.max_model_len
                                )
                                run_pass(address, warmup, float("inf"), options, "warmup")
                            label = f"{result.point.label()}"
                            passed = run_pass(
                                address, requests, traffic.request_rate, options, label, arrivals
                            )
                        result.summary = summarize(passed)
                        result.summary["label"] = label
                        result.goodput = _goodput(passed, args.slo_ttft_p99, args.slo_itl_p99)
                        if traffic.records is not None:
                            replayed = _replayed_records(request_log, _tag(label))
                            result.fidelity = replay_fidelity(traffic.records, requests, replayed)
                    except LaunchError as exc:
                        result.error = _launch_error(exc)
                    bar.update(1)
        except LaunchError as exc:  # the executors never served: every point of theirs fails
            for result in group:
                if result.summary is None and result.error is None:
                    result.error = _launch_error(exc)
                    bar.update(1)
    bar.close()
    for result in results:
        _judge(result, args.slo_ttft_p99, args.slo_itl_p99)
    return results


def _launch_error(exc: LaunchError) -> str:
    """Which service failed and the last line of its log (where the services say why)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = lines[0].split(";")[0] if lines else "launch failed"
    return f"{head}: {lines[-1]}" if len(lines) > 1 else head


def _tag(label: str) -> str:
    """The request-id tag `build_request` derives from a pass label."""
    import re

    return re.sub(r"[^A-Za-z0-9.]+", "-", label)


def recommend(
    results: Sequence[PointResult], objective: str, slo_ttft_ms: float | None, slo_itl_ms: float | None
) -> dict:
    """The best point for `objective` and why, in the seed's terms (see pagedserve.tune)."""
    ran = [r for r in results if r.summary is not None]
    choice: dict[str, Any] = {"objective": objective, "index": None, "label": None, "reasons": []}
    reasons: list[str] = choice["reasons"]
    if not ran:
        reasons.append("no point ran: see each point's error and the services' logs")
        return choice

    def score(r: PointResult) -> float:
        return (r.goodput if objective == "goodput" else r.metric("output_throughput")) or 0.0

    candidates = ran if objective == "goodput" else [r for r in ran if r.meets_slo]
    if not candidates:  # nothing met the bounds: the least violation, said plainly
        candidates = [min(ran, key=lambda r: (r.slo_violation, -score(r)))]
        reasons.append(
            "no point met the SLOs (or every point lost requests): this is the closest one; "
            "lower the load, or relax the bounds"
        )
    top = max(score(r) for r in candidates)
    # Replayed traffic arrives at its own pace, so points that keep up reach about the same
    # throughput: within TIE of the best they are tied, and the lowest p99 TTFT (then ITL) wins.
    tied = [r for r in candidates if score(r) >= (1 - TIE) * top]
    best = min(tied, key=lambda r: (r.metric("ttft_ms", "p99") or 0.0, r.metric("itl_ms", "p99") or 0.0))
    unit = "requests/s within the SLOs" if objective == "goodput" else "output tok/s"
    value = f"{score(best):,.2f} {unit}" if objective == "goodput" else f"{score(best):,.1f} {unit}"
    if len(tied) > 1:
        reasons.append(
            f"{len(tied)} points within {TIE:.0%} of the best {top:,.1f} {unit} (the traffic's arrivals "
            "bound it): the one with the lowest p99 TTFT"
        )
    choice.update(index=best.index, label=best.point.label(), executor_flags=best.point.executor_flags(),
                  scheduler_flags=best.point.scheduler_flags())  # fmt: skip
    slo = [f"p99 TTFT <= {slo_ttft_ms:g} ms"] if slo_ttft_ms is not None else []
    slo += [f"p99 ITL <= {slo_itl_ms:g} ms"] if slo_itl_ms is not None else []
    met = sum(r.meets_slo for r in ran)
    reasons.insert(
        0,
        f"{best.point.label()}: {value} ({len(ran)} points ran"
        + (f", {met} met {' and '.join(slo)})" if slo else ")"),
    )
    reasons += _explain(best, ran)
    return choice


def _per_100(r: PointResult) -> float:
    preemptions = r.metric("server", "preemptions") or 0
    return 100.0 * preemptions / max(r.summary["num_requests"], 1)


def _explain(best: PointResult, ran: Sequence[PointResult]) -> list[str]:
    """The seed's terms: pre-emption rate, prefix hit rate, memory headroom."""
    out = []
    rate = _per_100(best)
    worst = max(ran, key=_per_100)
    if _per_100(worst) >= FREQUENT_PREEMPTIONS and worst is not best:
        out.append(
            f"pre-emptions: {rate:.1f} per 100 requests here, {_per_100(worst):.1f} at "
            f"{worst.point.label()}: "
            "frequent pre-emptions mean the pool cannot hold that many sequences at once (lower "
            "--max-num-seqs or --max-model-len, or give the pool more memory)"
        )
    elif rate >= FREQUENT_PREEMPTIONS:
        out.append(
            f"pre-emptions: still {rate:.1f} per 100 requests here: lower --max-num-seqs or "
            "--max-model-len, or give the pool more memory (FP8 KV: --kv-cache-dtype fp8)"
        )
    else:
        out.append(f"pre-emptions: {rate:.1f} per 100 requests: the pool holds the traffic's sequences")
    hit = best.metric("server", "prefix_cache_hit_rate")
    twin = [
        r
        for r in ran
        if r.point.executor_key() == best.point.executor_key()
        and r.point.enable_prefix_caching != best.point.enable_prefix_caching
    ]
    if twin:
        on, off = (best, twin[0]) if best.point.enable_prefix_caching else (twin[0], best)
        hit = on.metric("server", "prefix_cache_hit_rate") or 0.0
        if hit < LOW_HIT_RATE:
            out.append(
                f"prefix caching: hit rate {hit:.1%}: prefixes seldom repeat, and caching only pays when "
                "they do (on or off makes little difference here)"
            )
        else:
            computed_on = on.metric("server", "prompt_tokens_computed")
            computed_off = off.metric("server", "prompt_tokens_computed")
            saved = 1 - computed_on / computed_off if computed_on is not None and computed_off else None
            gain = (on.metric("output_throughput") or 0) / max(off.metric("output_throughput") or 0, 1e-9) - 1
            ttft = (on.metric("ttft_ms", "p99") or 0) / max(off.metric("ttft_ms", "p99") or 0, 1e-9) - 1
            saving = "" if saved is None else f", {saved:.0%} fewer prompt tokens computed"
            out.append(
                f"prefix caching: hit rate {hit:.1%}{saving}; on vs off: {gain:+.1%} output tok/s, "
                f"{ttft:+.1%} p99 TTFT"
            )
    elif hit is not None:
        note = (
            "prefixes repeat: keep it on" if hit >= LOW_HIT_RATE else "caching only pays when prefixes repeat"
        )
        out.append(f"prefix cache hit rate {hit:.1%}: {note}")
    peak, blocks = best.metric("server", "peak_gpu_blocks_in_use"), best.metric("server", "num_gpu_blocks")
    if peak is not None and blocks:
        use = peak / blocks
        if use < HEADROOM:
            lower = [r for r in ran if r.point.gpu_memory_utilization < best.point.gpu_memory_utilization]
            hint = " (a lower --gpu-memory-utilization would serve it too)" if lower else ""
            out.append(f"memory headroom: peak KV use {use:.1%} of {blocks:,} blocks{hint}")
        else:
            out.append(
                f"memory headroom: peak KV use {use:.0%} of {blocks:,} blocks: the pool was the limit; more "
                "memory (--gpu-memory-utilization up to 0.92, --kv-cache-dtype fp8) would hold more"
            )
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def tune_table(results: Sequence[PointResult], choice: dict) -> str:
    header = ["point", "out tok/s", "goodput req/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "preempt",
              "peak KV", "hit rate", "SLO"]  # fmt: skip
    rows = []
    for r in results:
        mark = "* " if r.index == choice.get("index") else "  "
        if r.summary is None:
            rows.append([mark + r.point.label(), "failed", *[""] * 7])
            continue
        peak, blocks = r.metric("server", "peak_gpu_blocks_in_use"), r.metric("server", "num_gpu_blocks")
        hit = r.metric("server", "prefix_cache_hit_rate")
        rows.append([
            mark + r.point.label(),
            _fmt(r.metric("output_throughput")),
            _fmt(r.goodput, 2),
            f"{_fmt(r.metric('ttft_ms', 'p50'))} / {_fmt(r.metric('ttft_ms', 'p99'))}",
            f"{_fmt(r.metric('itl_ms', 'p50'), 2)} / {_fmt(r.metric('itl_ms', 'p99'), 2)}",
            str(r.metric("server", "preemptions")),
            f"{peak / blocks:.1%}" if peak is not None and blocks else "n/a",
            "n/a" if hit is None else f"{hit:.0%}",
            "yes" if r.meets_slo else "no",
        ])  # fmt: skip
    text = render_table("pagedserve tune (* = recommended)", header, rows)
    for r in results:
        if r.error:
            text += f"\nfailed ({r.point.label()}): {r.error}"
    text += "\n\nrecommended: " + (choice["label"] or "none")
    text += "".join(f"\n  - {reason}" for reason in choice["reasons"])
    if choice.get("executor_flags"):
        text += "\n  flags: executor " + shlex.join(choice["executor_flags"])
        text += "; scheduler " + shlex.join(choice["scheduler_flags"])
    for r in results:
        f = r.fidelity
        if f and not (f["prompt_lengths_equal"] and f["sharing_equal"] is not False):
            text += f"\nnote ({r.point.label()}): the replay differed from the log: {f}"
    return text


def write_tune_plot(
    path: Path, results: Sequence[PointResult], choice: dict, slo_ttft_ms: float | None
) -> None:
    """Output throughput against p99 TTFT, one dot per point, the recommended one marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    for r in results:
        x, y = r.metric("ttft_ms", "p99"), r.metric("output_throughput")
        if x is None or y is None:
            continue
        best = r.index == choice.get("index")
        ax.scatter([x], [y], s=220 if best else 50, marker="*" if best else "o",
                   color="tab:red" if best else "tab:blue", zorder=3)  # fmt: skip
        ax.annotate(r.point.label() + (" (recommended)" if best else ""), (x, y),
                    textcoords="offset points", xytext=(6, 4), fontsize="small")  # fmt: skip
    if slo_ttft_ms is not None:
        ax.axvline(slo_ttft_ms, color="grey", linestyle="--", label=f"SLO p99 TTFT {slo_ttft_ms:g} ms")
        ax.legend(fontsize="small")
    ax.margins(0.2)
    ax.set_xlabel("p99 time to first token (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("pagedserve tune: throughput against p99 TTFT")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
