"""`pagedserve tune`: settings recommended from your own traffic.

It replays a scheduler's `--request-log` (or a workload preset) against a grid of settings, one
launch of the services per point, the way `pagedserve bench --launch` starts them, and picks the
point that serves the traffic best: the most output tokens per second (`--objective throughput`)
among the points whose p99 TTFT and ITL meet `--slo-ttft-p99` / `--slo-itl-p99`, or the most
requests per second that each meet both (`--objective goodput`). The choice is explained in the
seed's terms: pre-emption rate (frequent pre-emptions: lower max_num_seqs or max_model_len), prefix
hit rate (caching only pays when prefixes repeat) and memory headroom (validate
`--gpu-memory-utilization` in 0.85-0.92 on real traffic).

Points that differ only in scheduler settings (`--enable-prefix-caching`) share one launch of the
executors: only the scheduler restarts, with an empty prefix cache. Every point's scheduler writes
its own request log, which is compared with the replayed one (lengths and prefix sharing) so the
result says whether the replay was faithful.

    pagedserve tune --model DIR --traffic requests.jsonl --max-num-seqs 128,256 --enable-prefix-caching on,off
    pagedserve tune --model DIR --workload W3 --request-rate 8 --slo-ttft-p99 500 --objective goodput
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.bench.workloads import PRESETS, LengthRange, Workload
from pagedserve.common.default_model import resolve_model

DEFAULT_UTILIZATIONS = "0.85,0.88,0.90,0.92"
REPLAY_TAG = "tune"  # the passes' request ids are bench-tune-<index>


@dataclass(frozen=True)
class GridPoint:
    """One setting of the grid; None leaves a flag at the services' default."""

    gpu_memory_utilization: float
    enable_prefix_caching: bool
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str | None = None

    def executor_key(self) -> tuple:
        """What the executors are launched with: points with equal keys share a launch."""
        return (
            self.max_num_seqs,
            self.gpu_memory_utilization,
            self.max_num_batched_tokens,
            self.kv_cache_dtype,
        )

    def _shared_flags(self) -> list[str]:  # the batch limits go to both services, as `serve` sends them
        flags = []
        if self.max_num_seqs is not None:
            flags += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            flags += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return flags

    def executor_flags(self) -> list[str]:
        flags = ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}", *self._shared_flags()]
        if self.kv_cache_dtype is not None:
            flags += ["--kv-cache-dtype", self.kv_cache_dtype]
        return flags

    def scheduler_flags(self) -> list[str]:
        caching = "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"
        return [*self._shared_flags(), caching]

    def label(self) -> str:
        parts = [
            f"util {self.gpu_memory_utilization:g}",
            f"caching {'on' if self.enable_prefix_caching else 'off'}",
        ]
        if self.max_num_seqs is not None:
            parts.insert(0, f"seqs {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None:
            parts.append(f"tokens {self.max_num_batched_tokens}")
        if self.kv_cache_dtype is not None:
            parts.append(f"kv {self.kv_cache_dtype}")
        return ", ".join(parts)


def _list_of(kind: Callable[[str], Any], expected: str, check: Callable[[Any], bool] = lambda v: True):
    """An argparse type for a comma-separated list of values (one value is a list of one)."""

    def convert(text: str) -> list:
        try:
            values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            values = []
        if not values or not all(check(v) for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated {expected}, got {text!r}")
        return list(dict.fromkeys(values))

    return convert


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError(text)
    return text == "on"


def _positive_number(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve tune",
        description="replay a request log (or a workload preset) over a grid of settings, launching the "
        "services for each point, and recommend the best one for an objective under latency SLOs",
    )
    p.add_argument(
        "--model", type=resolve_model, default="",
        help="model directory the services load (default or empty: the built-in model)",
    )  # fmt: skip
    source = p.add_argument_group("traffic (one of)")
    source.add_argument(
        "--traffic", type=Path, default=None, metavar="FILE",
        help="a scheduler's --request-log: replayed with its lengths, arrivals and prefix sharing",
    )  # fmt: skip
    source.add_argument("--workload", choices=tuple(PRESETS), help="a `pagedserve bench` workload preset")
    source.add_argument(
        "--num-prompts", type=int, default=None, help="with --workload: requests (default: the preset's)"
    )
    source.add_argument(
        "--request-rate", type=_positive_number, default=None,
        help="with --workload: Poisson arrivals in req/s (default: the preset's; W3 needs it)",
    )  # fmt: skip
    source.add_argument(
        "--time-scale", type=float, default=1.0,
        help="with --traffic: multiply the log's idle gaps (no request in flight) by this; 0 removes "
        "them, busy stretches keep their spacing (default 1)",
    )  # fmt: skip
    grid = p.add_argument_group("the grid (comma-separated values; every combination is one point)")
    grid.add_argument(
        "--max-num-seqs", type=_list_of(int, "positive integers", lambda v: v > 0), default=None,
        help="running sequences per step, to both services (default: theirs)",
    )  # fmt: skip
    grid.add_argument(
        "--gpu-memory-utilization",
        type=_list_of(float, "fractions in (0, 1]", lambda v: 0 < v <= 1),
        default=_list_of(float, "")(DEFAULT_UTILIZATIONS),
        help=f"the executor's share of GPU memory (default {DEFAULT_UTILIZATIONS}; one value on the CPU)",
    )
    grid.add_argument(
        "--enable-prefix-caching", type=_list_of(_on_off, "on/off"), default=[True],
        help="prefix caching: on, off or on,off (default on)",
    )  # fmt: skip
    grid.add_argument(
        "--max-num-batched-tokens", type=_list_of(int, "positive integers", lambda v: v > 0), default=None,
        help="tokens per step, to both services (default: theirs)",
    )  # fmt: skip
    grid.add_argument(
        "--kv-cache-dtype", type=_list_of(str, "auto/fp8", lambda v: v in ("auto", "fp8")), default=None,
        help="KV cache dtype: auto, fp8 or auto,fp8 (default: the executor's)",
    )  # fmt: skip
    choose = p.add_argument_group("the choice")
    choose.add_argument(
        "--objective", choices=("throughput", "goodput"), default="throughput",
        help="throughput: output tok/s among points meeting the SLOs' p99; goodput: requests/s that each "
        "meet every SLO given",
    )  # fmt: skip
    choose.add_argument(
        "--slo-ttft-p99", type=_positive_number, default=None, metavar="MS", help="TTFT bound (ms)"
    )
    choose.add_argument(
        "--slo-itl-p99", type=_positive_number, default=None, metavar="MS",
        help="inter-token latency bound (ms; per request, its mean for goodput)",
    )  # fmt: skip
    run = p.add_argument_group("the runs")
    run.add_argument("--executor-args", default="", help="more executor flags for every point (one string)")
    run.add_argument("--scheduler-args", default="", help="more scheduler flags for every point (one string)")
    run.add_argument(
        "--num-warmups", type=int, default=8,
        help="short unrelated requests before each point's pass (kernels compile outside it; default 8)",
    )  # fmt: skip
    run.add_argument("--seed", type=int, default=1, help="seed of the synthesized prompts and arrivals")
    run.add_argument("--request-timeout", type=_positive_number, default=None, help="seconds per request")
    run.add_argument(
        "--launch-timeout",
        type=_positive_number,
        default=900.0,
        help="seconds the services may take to serve",
    )
    run.add_argument(
        "--result-file", type=Path, default=Path("tune-results/tune.json"), help="JSON of every point"
    )
    run.add_argument("--plot", type=Path, default=None, help="PNG path (default: the result file with .png)")
    run.add_argument("--no-plot", action="store_true", help="write no plot")
    run.add_argument(
        "--log-dir", type=Path, default=None, help="services' logs (default: beside the result file)"
    )
    return p


def grid_points(args: argparse.Namespace, on_cpu: bool) -> list[GridPoint]:
    """Every combination of the grid's values; on the CPU the pool does not depend on the
    utilization, so only its first value is used."""
    utilizations = args.gpu_memory_utilization[:1] if on_cpu else args.gpu_memory_utilization
    axes = itertools.product(
        args.max_num_seqs or [None],
        utilizations,
        args.max_num_batched_tokens or [None],
        args.kv_cache_dtype or [None],
        args.enable_prefix_caching,
    )
    points = [GridPoint(u, caching, seqs, tokens, kv) for seqs, u, tokens, kv, caching in axes]
    return sorted(points, key=lambda p: (str(p.executor_key()), not p.enable_prefix_caching))


def _preset_workload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Workload, float]:
    preset = PRESETS[args.workload]
    rate = args.request_rate or float(preset.get("request_rate", "nan"))
    if math.isnan(rate):
        parser.error(f"--workload {args.workload} needs --request-rate R (Poisson arrivals in req/s)")
    workload = Workload(
        dataset=preset["dataset"],
        num_prompts=args.num_prompts or preset["num_prompts"],
        input_len=LengthRange.parse(preset["input_len"]),
        output_len=LengthRange.parse(preset["output_len"]),
        prefix_len=preset.get("prefix_len", 0),
        seed=args.seed,
        num_prefixes=preset.get("num_prefixes", 1),
    )
    return workload, rate


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Bad combinations fail now, with argparse's one error line, before any launch."""
    if (args.traffic is None) == (args.workload is None):
        parser.error("give the traffic to replay: --traffic FILE (a --request-log) or --workload W")
    if args.traffic is not None and (args.num_prompts is not None or args.request_rate is not None):
        parser.error("--num-prompts and --request-rate shape a --workload preset, not a --traffic log")
    if args.time_scale != 1.0 and args.traffic is None:
        parser.error("--time-scale compresses a --traffic log's idle gaps; a preset has none")
    if not args.time_scale >= 0:
        parser.error(f"--time-scale must be >= 0, got {args.time_scale}")
    if args.num_prompts is not None and args.num_prompts < 1:
        parser.error(f"--num-prompts must be positive, got {args.num_prompts}")
    if args.num_warmups < 0:
        parser.error(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.objective == "goodput" and args.slo_ttft_p99 is None and args.slo_itl_p99 is None:
        parser.error(
            "--objective goodput counts requests that meet the SLOs: give --slo-ttft-p99 and/or --slo-itl-p99"
        )
    if args.result_file.is_dir():
        parser.error(f"--result-file {args.result_file} is a directory; name a file")
    try:
        shlex.split(args.executor_args), shlex.split(args.scheduler_args)
    except ValueError as exc:
        parser.error(f"--executor-args/--scheduler-args: {exc}")


@dataclass
class Traffic:
    """What every point sends: requests are synthesized once the first server says its vocabulary."""

    label: str
    records: list | None  # the replayed log's records (--traffic)
    stats: dict | None
    workload: Workload | None
    request_rate: float
    time_scale: float
    seed: int

    def requests_and_arrivals(self, vocab_size: int, max_model_len: int | None):
        from pagedserve.bench.replay import replay_arrivals, replay_requests
        from pagedserve.bench.workloads import arrival_times, generate_requests

        if self.records is not None:
            requests = replay_requests(self.records, vocab_size, max_model_len, self.seed)
            return requests, replay_arrivals(self.records, self.time_scale)
        requests = generate_requests(self.workload, vocab_size, max_model_len)
        return requests, arrival_times(len(requests), self.request_rate, self.seed)


def load_traffic(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Traffic:
    from pagedserve.bench.replay import traffic_stats
    from pagedserve.common.request_log import RequestLogError, read_request_log

    if args.traffic is not None:
        try:
            records = read_request_log(args.traffic)
        except RequestLogError as exc:
            parser.error(str(exc))
        stats = dataclasses.asdict(traffic_stats(records))
        return Traffic(str(args.traffic), records, stats, None, math.inf, args.time_scale, args.seed)
    workload, rate = _preset_workload(args, parser)
    return Traffic(f"{args.workload} at {rate:g} req/s", None, None, workload, rate, 1.0, args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    traffic = load_traffic(args, parser)
    from pagedserve.bench.inprocess import executor_config, service_config
    from pagedserve.bench.tuning import recommend, run_grid, tune_table, write_tune_plot

    base = executor_config(args.model, args.executor_args, prog="pagedserve tune --executor-args")
    on_cpu = base.torch_device().type == "cpu"
    points = grid_points(args, on_cpu)
    if on_cpu and len(args.gpu_memory_utilization) > 1:
        print("tune: the executor runs on the CPU, where --gpu-memory-utilization does not size the pool: "
              f"only {args.gpu_memory_utilization[0]:g} is run", file=sys.stderr)  # fmt: skip
    for point in points:  # every point's flags are checked by the services' own parsers, now
        joined = shlex.join(point.executor_flags())
        executor_config(args.model, f"{args.executor_args} {joined}", prog="pagedserve tune")
        service_config(
            args.model, f"{args.scheduler_args} {shlex.join(point.scheduler_flags())}", prog="pagedserve tune"
        )
    try:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--result-file {args.result_file}: {exc}")
    log_dir = args.log_dir or args.result_file.parent / "logs"
    results = run_grid(args, base, points, traffic, log_dir)
    choice = recommend(results, args.objective, args.slo_ttft_p99, args.slo_itl_p99)
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "traffic": {"source": traffic.label, "stats": traffic.stats},
        "points": [r.to_json() for r in results],
        "recommendation": choice,
    }
    args.result_file.write_text(json.dumps(report, indent=2) + "\n")
    if not args.no_plot:
        write_tune_plot(args.plot or args.result_file.with_suffix(".png"), results, choice, args.slo_ttft_p99)
    print(tune_table(results, choice))
    print(f"\nresults: {args.result_file}", file=sys.stderr)
    return 0 if choice["index"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
