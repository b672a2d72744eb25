"""The command line of `pagedserve bench`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from pagedserve.bench.baselines import run_hf_cb, run_hf_static
from pagedserve.bench.client import (
    PassResult,
    SendOptions,
    get_model_info,
    read_floor_inputs,
    run_pass,
    warmup_requests,
)
from pagedserve.bench.launch import LaunchError, launched_server
from pagedserve.bench.metrics import compare_outputs, output_matches, summarize
from pagedserve.bench.report import baseline_table, results_table, write_plot
from pagedserve.bench.workloads import (
    DATASETS,
    DEFAULTS,
    PRESETS,
    BenchRequest,
    LengthRange,
    Workload,
    plan_passes,
)


def _flag_type(expected: str, check: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type`: `check` returns the value or raises ValueError, which becomes argparse's
    "argument --flag: expected ..." error (exit 2) now, not a traceback once the run has begun."""

    def convert(text: str) -> Any:
        try:
            return check(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None

    return convert


def _positive(value: float) -> float:
    if not value > 0:  # also refuses nan
        raise ValueError(value)
    return value


def _non_negative(value: float) -> float:
    if not value >= 0:
        raise ValueError(value)
    return value


def _length_text(minimum: int) -> Callable[[str], str]:
    """N or MIN:MAX, checked but kept as text, the way the presets write lengths."""

    def check(text: str) -> str:
        if LengthRange.parse(text).lo < minimum:
            raise ValueError(text)
        return text

    return _flag_type(f"N or MIN:MAX with {minimum} <= MIN <= MAX", check)


def _rate_text(text: str) -> str:
    """A rate, checked but kept as text: the JSON config then says "inf", not Infinity (not JSON)."""
    _positive(float(text))
    return text


def _rates_text(text: str) -> str:
    for part in text.split(","):
        _rate_text(part)
    return text


def _concurrencies(text: str) -> list[int]:
    """N, or N1,N2,...: positive integers (one pass per value)."""
    values = [int(part) for part in text.split(",")]
    for value in values:
        _positive(value)
    return values


_RATE = "'inf' or a positive number of requests/s"
_positive_int = _flag_type("a positive integer", lambda t: _positive(int(t)))
_non_negative_int = _flag_type("an integer >= 0", lambda t: _non_negative(int(t)))
_positive_float = _flag_type("a positive number", lambda t: _positive(float(t)))
_non_negative_float = _flag_type("a number >= 0", lambda t: _non_negative(float(t)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve bench", description="benchmark a pagedserve server over gRPC (or in-process)"
    )
    p.add_argument("--host", default="127.0.0.1", help="the scheduler's address (not with --launch)")
    p.add_argument("--port", type=int, default=50051, help="the scheduler's public port")
    p.add_argument(
        "--workload",
        choices=tuple(PRESETS),
        help="a preset of the workloads in docs/performance/index.md; explicit flags override it",
    )
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        help="random token ids, prompts sharing prefixes, multi-turn conversations (W6), or "
        "held-out Python files with an edit request (W7: needs --model for its tokenizer)",
    )
    p.add_argument("--num-prompts", type=_positive_int, help="requests per pass")
    p.add_argument(
        "--input-len", type=_length_text(0), help="prompt tokens (suffix for shared-prefix): N or MIN:MAX"
    )
    p.add_argument("--output-len", type=_length_text(1), help="output tokens: N or MIN:MAX")
    p.add_argument("--prefix-len", type=_non_negative_int, help="shared-prefix: tokens of the common prefix")
    p.add_argument(
        "--num-prefixes",
        type=_positive_int,
        help="shared-prefix: distinct prefixes; request i uses prefix i mod this (interleaved)",
    )
    p.add_argument(
        "--request-rate",
        type=_flag_type(_RATE, _rate_text),
        help="'inf' (all at t=0) or a Poisson rate in req/s",
    )
    p.add_argument(
        "--request-rates",
        type=_flag_type(f"comma-separated rates, each {_RATE}", _rates_text),
        help="comma-separated rates: one pass per rate, tabled together",
    )
    p.add_argument(
        "--max-concurrency",
        type=_flag_type("a positive integer or comma-separated ones", _concurrencies),
        default=None,
        help="requests in flight at most (default: no limit); N1,N2,...: one pass per limit (at each "
        "rate), tabled together, e.g. 1,8,32 for per-token latency at small batches",
    )
    p.add_argument(
        "--num-turns",
        type=_positive_int,
        help="multi-turn: turns per conversation (--num-prompts: conversations)",
    )
    p.add_argument(
        "--think-time",
        type=_non_negative_float,
        help="multi-turn: seconds between an answer and the next turn",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the generated prompts and lengths")
    p.add_argument(
        "--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
        help="generate every request's full output length",
    )  # fmt: skip
    p.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--num-warmups",
        type=_non_negative_int,
        default=0,
        help="short unrelated requests sent before measuring",
    )
    p.add_argument("--request-timeout", type=_positive_float, default=None, help="seconds per request")
    p.add_argument(
        "--result-file",
        type=Path,
        default=Path("bench-results/bench.json"),
        help="JSON of every pass and request",
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: the result file with .png)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    launch = p.add_argument_group("launched services")
    launch.add_argument("--launch", action="store_true", help="start executor + scheduler on loopback")
    # Absolute: the launched services run in the package's folder, not the caller's.
    launch.add_argument(
        "--model", type=lambda path: str(Path(path).resolve()), help="model directory (--launch, baselines)"
    )
    launch.add_argument(
        "--log-likelihood", action="store_true",
        help="score held-out text through the executor instead (see `pagedserve bench --log-likelihood -h`)",
    )  # fmt: skip
    launch.add_argument("--executor-args", default="", help="extra executor flags (one shell-quoted string)")
    launch.add_argument(
        "--scheduler-args", default="", help="extra scheduler flags (one shell-quoted string)"
    )
    launch.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help="with --launch or --in-process: speculative decoding for both services (the flag of "
        "`pagedserve serve`, added to --executor-args and --scheduler-args); the report adds the "
        "acceptance rate, mean accepted length and steps per output token",
    )  # fmt: skip
    launch.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        default=1,
        help="with --launch: executors behind the one scheduler, placed on GPUs as `pagedserve serve "
        "--data-parallel-size` places them (compare routing with --scheduler-args)",
    )
    launch.add_argument(
        "--launch-timeout",
        type=_positive_float,
        default=900.0,
        help="seconds the launched services may take to serve",
    )
    launch.add_argument("--log-dir", type=Path, default=None, help="default: next to the result file")
    launch.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="with --launch: run with prefix caching on, then off",
    )
    local = p.add_argument_group("in-process (the same engine and runner in this process, no gRPC)")
    local.add_argument(
        "--in-process",
        action="store_true",
        help="run the workload in this process (needs --model; takes --executor-args, --scheduler-args)",
    )
    local.add_argument(
        "--compare-in-process",
        action="store_true",
        help="with --launch: the gRPC services first, then in-process; reports the service split cost",
    )
    gateway = p.add_argument_group("through the OpenAI-compatible gateway (the openai async client)")
    gateway.add_argument(
        "--through-openai", metavar="URL", action="append", default=None,
        help="send the requests through the gateway at URL (--host/--port: its scheduler, for "
        "counters); repeatable: the client processes spread over the gateways",
    )  # fmt: skip
    gateway.add_argument(
        "--compare-openai",
        action="store_true",
        help="with --launch: over gRPC, then through a launched gateway streamed and not; reports its cost",
    )
    gateway.add_argument(
        "--openai-gateways",
        type=_positive_int,
        default=1,
        metavar="G",
        help="with --compare-openai: launch G gateway processes, the client processes spread over them",
    )
    gateway.add_argument(
        "--openai-client-processes",
        type=_positive_int,
        default=None,
        metavar="P",
        help="client processes that share out the gateway passes' requests, each with its own event "
        "loop and openai client, all starting at one instant (default: min(8, CPU cores); 1 with "
        "--max-concurrency)",
    )
    base = p.add_argument_group("Hugging Face baselines (run after the pagedserve pass)")
    base.add_argument(
        "--baseline", action="append", choices=("hf-static", "hf-cb"), default=[],
        help="Hugging Face generate in static batches, or its continuous batching; repeatable",
    )  # fmt: skip
    base.add_argument(
        "--baseline-num-prompts", type=_positive_int, default=None, help="the first N requests (default all)"
    )
    base.add_argument("--baseline-batch-size", type=_positive_int, default=64, help="hf-static batch size")
    base.add_argument("--baseline-device", default="auto", help="auto, cpu or cuda[:N]")
    return p


def resolve(args: argparse.Namespace) -> tuple[Workload, list[float]]:
    """The workload and request rates: explicit flags, then the preset, then the defaults."""
    preset = PRESETS.get(args.workload or "", {})

    def pick(name: str):
        value = getattr(args, name)
        return value if value is not None else preset.get(name, DEFAULTS.get(name))

    if args.request_rate is not None and args.request_rates:
        raise SystemExit("pagedserve bench: give --request-rate R or --request-rates R1,R2,..., not both")
    dataset = pick("dataset")
    for flag in ("prefix_len", "num_prefixes"):
        if getattr(args, flag) is not None and dataset != "shared-prefix":
            name = "--" + flag.replace("_", "-")
            raise SystemExit(f"pagedserve bench: {name} needs --dataset shared-prefix (or --workload W2, W4)")
    for flag in ("num_turns", "think_time"):
        if getattr(args, flag) is not None and dataset != "multi-turn":
            name = "--" + flag.replace("_", "-")
            raise SystemExit(f"pagedserve bench: {name} needs --dataset multi-turn (or --workload W6)")
    if dataset == "source-edit" and not args.model:
        raise SystemExit(
            "pagedserve bench: W7 (--dataset source-edit) needs --model DIR: its tokenizer cuts the files"
        )
    prefix_len = pick("prefix_len") if dataset == "shared-prefix" else 0
    if dataset == "shared-prefix" and args.prefix_len is None and "prefix_len" not in preset:
        prefix_len = 256
    if prefix_len == 0 and LengthRange.parse(pick("input_len")).lo == 0:  # the server refuses them
        raise SystemExit("pagedserve bench: --input-len 0 makes empty prompts; give a MIN of 1 or more")
    workload = Workload(
        dataset=dataset,
        num_prompts=pick("num_prompts"),
        input_len=LengthRange.parse(pick("input_len")),
        output_len=LengthRange.parse(pick("output_len")),
        prefix_len=prefix_len,
        seed=args.seed,
        num_prefixes=pick("num_prefixes") if dataset == "shared-prefix" else 1,
        structured_outputs=preset.get("structured_outputs"),
        num_turns=pick("num_turns") if dataset == "multi-turn" else 1,
        think_time=pick("think_time") if dataset == "multi-turn" else 0.0,
        tokenizer=args.model if dataset == "source-edit" else None,
    )
    if args.request_rates:
        rates = [float(x) for x in args.request_rates.split(",") if x.strip()]
    elif args.request_rate is not None or "request_rate" in preset:
        rates = [float(pick("request_rate"))]
    elif args.workload == "W3":
        raise SystemExit("pagedserve bench: W3 needs --request-rate R or --request-rates R1,R2,...")
    else:
        rates = [float(DEFAULTS["request_rate"])]
    if any(r <= 0 for r in rates):
        raise SystemExit("pagedserve bench: request rates must be positive")
    return workload, rates


def send_options(args: argparse.Namespace, max_concurrency: int | None = None) -> SendOptions:
    """The send options of a pass at `max_concurrency` (default: the first --max-concurrency)."""
    if max_concurrency is None and args.max_concurrency:
        max_concurrency = args.max_concurrency[0]
    return SendOptions(args.temperature, args.ignore_eos, args.seed, max_concurrency, args.request_timeout)


def _measure(
    address: str, workload: Workload, rates: Sequence[float], args: argparse.Namespace, tag: str = ""
) -> tuple[list[BenchRequest], list[PassResult]]:
    """Every pass against one server: model info, optional warmup, one pass per rate (see
    `plan_passes`). Returns the first pass's requests (the ones the baselines replay) and the passes."""
    try:
        info = get_model_info(address)
    except grpc.RpcError as exc:  # the usual first mistake: no server there (yet)
        raise SystemExit(
            f"pagedserve bench: no pagedserve server answers at {address} ({exc.code().name}: "
            f"{exc.details()}); start one (pagedserve serve) or pass --launch --model DIR"
        ) from None
    if args.num_warmups:
        warmup = warmup_requests(args.num_warmups, info.vocab_size, info.max_model_len)
        run_pass(address, warmup, math.inf, send_options(args), "warmup")
    floor = read_floor_inputs(address)  # after the warm-up: the executors have attached
    # One pass per (limit, rate), each with fresh prompts (`plan_passes` seeds pass k with seed + k).
    limits = args.max_concurrency or [None]
    pairs = [(limit, rate) for limit in limits for rate in rates]
    planned = plan_passes(workload, [r for _, r in pairs], info.vocab_size, info.max_model_len or None, tag)
    passes = []
    for (limit, _), p in zip(pairs, planned, strict=True):
        label = p.label + (f", concurrency {limit}" if len(limits) > 1 else "")
        passes.append(run_pass(address, p.requests, p.request_rate, send_options(args, limit), label))
        passes[-1].seed, passes[-1].max_concurrency, passes[-1].floor_inputs = p.seed, limit, floor
    return planned[0].requests, passes


def _in_process_configs(args: argparse.Namespace):
    """The executor and scheduler configs of the in-process pass, from the launched services' flags."""
    from pagedserve.bench.inprocess import executor_config, service_config  # imports torch

    return executor_config(args.model, args.executor_args), service_config(args.model, args.scheduler_args)


def _measure_in_process(
    args: argparse.Namespace, workload: Workload, rates: Sequence[float]
) -> tuple[list[BenchRequest], list[PassResult]]:
    from pagedserve.bench.inprocess import run_in_process

    executor, service = _in_process_configs(args)
    if args.compare_in_process and executor.step_trace:  # the gRPC pass's trace stays as it is
        trace = Path(executor.step_trace)
        executor = dataclasses.replace(executor, step_trace=str(trace.with_stem(trace.stem + "-in-process")))
    print(f"bench: in-process engine and runner on {executor.device} (no gRPC)", file=sys.stderr)
    return run_in_process(executor, service, workload, rates, send_options(args), args.num_warmups)


def _measure_openai(
    urls: Sequence[str],
    scheduler: str,
    workload: Workload,
    rates: Sequence[float],
    args: argparse.Namespace,
    stream: bool,
    pids: Sequence[int] = (),
) -> list[PassResult]:
    """`_measure`'s passes, the same requests, sent through the gateway(s) at `urls` (the client
    processes spread over them); with the gateways' `pids`, their CPU seconds over each pass."""
    from pagedserve.bench.openai_client import process_cpu_seconds, run_openai_pass

    info = get_model_info(scheduler)
    options = send_options(args)
    processes = args.openai_client_processes
    tag = f"openai {'stream' if stream else 'plain'}"
    if args.num_warmups:
        warmup = warmup_requests(args.num_warmups, info.vocab_size, info.max_model_len)
        run_openai_pass(urls, scheduler, warmup, math.inf, options, "warmup", stream, processes)
    passes = []
    for p in plan_passes(workload, list(rates), info.vocab_size, info.max_model_len or None, tag):
        before = [process_cpu_seconds(pid) for pid in pids]
        result = run_openai_pass(
            urls, scheduler, p.requests, p.request_rate, options, p.label, stream, processes
        )
        after = [process_cpu_seconds(pid) for pid in pids]
        if pids and None not in before + after:
            result.gateway_cpu_s = sum(after) - sum(before)
        result.seed = p.seed
        passes.append(result)
    return passes


def run_pagedserve(
    args: argparse.Namespace, workload: Workload, rates: Sequence[float]
) -> tuple[list[BenchRequest], list[PassResult]]:
    """All pagedserve passes: against --host/--port, in-process, or launched servers (twice to
    compare caching; then in-process to compare with it)."""
    if args.in_process:
        return _measure_in_process(args, workload, rates)
    if args.through_openai and not args.launch:
        address = f"{args.host}:{args.port}"
        requests = plan_passes(workload, list(rates), *_vocab_and_len(address))[0].requests
        return requests, _measure_openai(args.through_openai, address, workload, rates, args, stream=True)
    if not args.launch:
        return _measure(f"{args.host}:{args.port}", workload, rates, args)
    log_dir = args.log_dir or args.result_file.parent / "logs"
    executor_args, scheduler_args = shlex.split(args.executor_args), shlex.split(args.scheduler_args)
    executor = _in_process_configs(args)[0]
    placement = dict(
        data_parallel_size=args.data_parallel_size,
        device=executor.device,
        gpu_memory_utilization=executor.gpu_memory_utilization,
        tensor_parallel_size=executor.tensor_parallel_size,
    )
    if args.compare_openai:  # the same prompts go three times: none may find the others' KV cached
        scheduler_args = [*scheduler_args, "--no-enable-prefix-caching"]
    settings = [(None, scheduler_args)]
    if args.compare_prefix_caching:
        settings = [(True, scheduler_args), (False, [*scheduler_args, "--no-enable-prefix-caching"])]
    passes: list[PassResult] = []
    for caching, sched in settings:
        tag = "" if caching is None else f"prefix caching {'on' if caching else 'off'}"
        tag = "gRPC" if args.compare_in_process else tag
        sub_dir = log_dir if caching is None else log_dir / ("caching-on" if caching else "caching-off")
        try:
            with launched_server(
                args.model, sub_dir, executor_args, sched, args.launch_timeout, **placement
            ) as address:
                requests, results = _measure(
                    address, workload, rates, args, "gRPC" if args.compare_openai else tag
                )
                if args.compare_openai:  # the same requests through a gateway, streamed then not
                    from pagedserve.bench.openai_client import launched_gateways

                    with launched_gateways(address, sub_dir, args.openai_gateways) as gateways:
                        urls, pids = [g.url for g in gateways], [g.pid for g in gateways]
                        for stream in (True, False):
                            results += _measure_openai(urls, address, workload, rates, args, stream, pids)
        except LaunchError as exc:  # its message carries the failing service's log
            raise SystemExit(f"pagedserve bench: {exc}") from None
        for result in results:
            result.prefix_caching = caching
        passes += results
    if args.compare_in_process:  # the launched services have stopped: the device is free again
        passes += _measure_in_process(args, workload, rates)[1]
    return requests, passes


def _vocab_and_len(address: str) -> tuple[int, int | None]:
    info = get_model_info(address)
    return info.vocab_size, info.max_model_len or None


def openai_comparison(grpc_pass: PassResult, stream: PassResult, plain: PassResult, greedy: bool) -> dict:
    """Issue 15's report: output throughput through the OpenAI gateway (streamed and not) against
    the same requests straight over gRPC, on the same services; the gateway should cost <= 5%.
    Greedy outputs are compared request by request: the fraction that match exactly, and where the
    first differing ones diverge (index@token)."""
    runs = [summarize(p) for p in (grpc_pass, stream, plain)]
    grpc_tps = runs[0]["output_throughput"]
    comparison = {
        "output tok/s (gRPC)": grpc_tps,
        "output tok/s from the first token (gRPC)": after_first_token(grpc_pass),
        "requests issued in (s), gRPC": issue_spread(grpc_pass),
    }
    for name, run, result in (("stream", runs[1], stream), ("plain", runs[2], plain)):
        tps = run["output_throughput"]
        comparison[f"output tok/s (openai {name})"] = tps
        comparison[f"gateway cost, {name} (1 - openai/gRPC)"] = 1 - tps / grpc_tps if grpc_tps else None
        if name == "stream":  # a response not streamed has no first token to time
            comparison["output tok/s from the first token (openai stream)"] = after_first_token(result)
        comparison[f"requests issued in (s), {name}"] = issue_spread(result)
        comparison[f"client CPU (s), {name}"] = result.client_cpu_s
        if result.gateway_cpu_s is not None:  # busy cores: near 1 per gateway, it is the bottleneck
            comparison[f"gateway CPU (s), {name}"] = result.gateway_cpu_s
            comparison[f"gateway CPU / duration (cores), {name}"] = result.gateway_cpu_s / run["duration_s"]
        if not greedy:
            continue
        matches = output_matches(grpc_pass, result)
        differing = {i: pos for i, pos in matches.items() if pos is not None}
        comparison[f"greedy outputs identical ({name})"] = bool(matches) and not differing
        same = len(matches) - len(differing)
        comparison[f"greedy requests identical ({name})"] = (
            f"{same} / {len(matches)} ({same / len(matches):.1%})" if matches else None
        )
        if differing:
            shown = ", ".join(f"{i}@{pos}" for i, pos in sorted(differing.items())[:10])
            comparison[f"greedy differing ({name}, index@token)"] = shown + (
                ", ..." if len(differing) > 10 else ""
            )
    return comparison


def after_first_token(result: PassResult) -> float | None:
    """Output tokens per second from the pass's first token to its end: the throughput without
    the time it took to issue the requests and prefill the first ones."""
    times = [t for r in result.records if r.ok for t in r.message_times]
    if not times:
        return None
    first = min(times)
    tokens = sum(r.num_output for r in result.records if r.ok)
    return tokens / (result.end - first) if result.end > first else None


def mark_matches(run: dict, matches: dict[int, int | None], against: str) -> None:
    """Each request's record in `run` (a `summarize` dict) says whether its greedy tokens equal
    those of the same request in the pass `against`, and else the first token where they differ."""
    for request in run["requests"]:
        if request["index"] in matches:
            position = matches[request["index"]]
            request[f"identical_to_{against}"] = position is None
            request["first_difference"] = position


def issue_spread(result: PassResult) -> float | None:
    """Seconds from the pass's start until its last request was sent: for an all-at-once workload
    (rate inf), how long the client itself needed to issue them."""
    if not math.isinf(result.request_rate) or not result.records:
        return None
    return max(r.start for r in result.records) - result.start


def caching_comparison(on: PassResult, off: PassResult, greedy: bool) -> dict:
    """W2's report: prefill work, hit rate and total time with prefix caching on vs off."""
    run_on, run_off = summarize(on), summarize(off)
    s_on, s_off = run_on["server"] or {}, run_off["server"] or {}
    computed_on, computed_off = s_on.get("prompt_tokens_computed"), s_off.get("prompt_tokens_computed")
    outputs = compare_outputs(on, off)
    comparison = {
        "prefill tokens computed (on)": computed_on,
        "prefill tokens computed (off)": computed_off,
        "prefill computed ratio on/off": computed_on / computed_off if computed_on and computed_off else None,
        "prefix cache hit rate (on, hit/query)": s_on.get("prefix_cache_hit_rate"),
        "cached prompt tokens (on, usage)": run_on["cached_prompt_fraction"],
        "total time on (s)": run_on["duration_s"],
        "total time off (s)": run_off["duration_s"],
        "total time ratio on/off": run_on["duration_s"] / run_off["duration_s"],
        "greedy outputs identical": outputs["identical"] if greedy else None,
        "requests compared": outputs["compared"],
    }
    if outputs["differing"]:
        comparison["differing request indices"] = ",".join(map(str, outputs["differing"]))
    return comparison


def split_comparison(grpc_pass: PassResult, local_pass: PassResult, greedy: bool) -> dict:
    """Issue 5's report: output throughput through the gRPC services (three processes) against the
    same engine and runner in one process; the split should cost at most 5%."""
    run_grpc, run_local = summarize(grpc_pass), summarize(local_pass)
    grpc_tps, local_tps = run_grpc["output_throughput"], run_local["output_throughput"]
    ratio = grpc_tps / local_tps if local_tps else None
    outputs = compare_outputs(grpc_pass, local_pass)
    comparison = {
        "output tok/s (gRPC)": grpc_tps,
        "output tok/s (in-process)": local_tps,
        "output throughput ratio gRPC/in-process": ratio,
        "service split cost (1 - gRPC/in-process)": None if ratio is None else 1 - ratio,
        "total time gRPC (s)": run_grpc["duration_s"],
        "total time in-process (s)": run_local["duration_s"],
        "greedy outputs identical": outputs["identical"] if greedy else None,
        "requests compared": outputs["compared"],
    }
    if outputs["differing"]:
        comparison["differing request indices"] = ",".join(map(str, outputs["differing"]))
    return comparison


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--log-likelihood" in argv:  # a quality measurement with flags of its own
        from pagedserve.bench.loglik import main as loglik_main

        return loglik_main(argv)
    args = build_parser().parse_args(argv)
    workload, rates = resolve(args)
    if (args.launch or args.baseline) and not args.model:
        raise SystemExit("pagedserve bench: --launch and --baseline need --model DIR")
    if args.compare_prefix_caching and not args.launch:
        raise SystemExit("pagedserve bench: --compare-prefix-caching needs --launch")
    if args.data_parallel_size > 1 and (not args.launch or args.compare_in_process):
        raise SystemExit(
            "pagedserve bench: --data-parallel-size needs --launch (and no --compare-in-process)"
        )
    if args.in_process and (args.launch or not args.model):
        raise SystemExit("pagedserve bench: --in-process needs --model DIR (and no --launch)")
    if args.compare_in_process and (not args.launch or args.compare_prefix_caching):
        raise SystemExit("pagedserve bench: --compare-in-process needs --launch (and no other comparison)")
    if args.compare_openai and (not args.launch or args.compare_prefix_caching or args.compare_in_process):
        raise SystemExit("pagedserve bench: --compare-openai needs --launch (and no other comparison)")
    if args.through_openai and (args.launch or args.in_process):
        raise SystemExit("pagedserve bench: --through-openai URL goes to a running gateway (no --launch)")
    if args.openai_gateways > 1 and not args.compare_openai:
        raise SystemExit("pagedserve bench: --openai-gateways launches gateways for --compare-openai")
    if args.max_concurrency and len(args.max_concurrency) > 1 and (
        args.in_process or args.compare_in_process or args.compare_openai or args.through_openai
        or args.compare_prefix_caching
    ):  # fmt: skip
        raise SystemExit(
            "pagedserve bench: a list of --max-concurrency limits runs gRPC passes only (no in-process, "
            "OpenAI or prefix-caching comparison); give one limit"
        )
    if (args.openai_client_processes or 1) > 1 and args.max_concurrency:
        raise SystemExit(
            "pagedserve bench: --max-concurrency is one limit over all requests: it needs one client "
            "process (--openai-client-processes 1)"
        )
    if (args.compare_openai or args.through_openai) and args.openai_client_processes is None:
        from pagedserve.bench.openai_client import default_client_processes

        args.openai_client_processes = 1 if args.max_concurrency else default_client_processes()
    if args.speculative_config:
        if not (args.in_process or args.launch):
            raise SystemExit(
                "pagedserve bench: --speculative-config configures launched or in-process services "
                "(--launch, --in-process); a running server has its own"
            )
        flag = " --speculative-config " + shlex.quote(args.speculative_config)
        args.executor_args += flag
        args.scheduler_args += flag
    if args.in_process or args.launch:  # bad service flags fail now, not in a launched process
        _in_process_configs(args)
    # Written after the run: a path that cannot be a file fails now, not after minutes of load.
    if args.result_file.is_dir():
        raise SystemExit(f"pagedserve bench: --result-file {args.result_file} is a directory; name a file")
    try:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"pagedserve bench: --result-file {args.result_file}: {exc}") from None

    requests, passes = run_pagedserve(args, workload, rates)
    runs = [summarize(p) for p in passes]
    comparison, title = None, ""
    if args.compare_prefix_caching:  # passes: [on at each rate..., off at each rate...]
        comparison = caching_comparison(passes[0], passes[len(passes) // 2], args.temperature == 0)
        title = "prefix caching on vs off"
    elif args.compare_openai:  # passes: [gRPC..., openai stream..., openai plain...] at each rate
        n = len(rates)
        comparison = openai_comparison(passes[0], passes[n], passes[2 * n], args.temperature == 0)
        if args.temperature == 0:
            for k in (n, 2 * n):
                mark_matches(runs[k], output_matches(passes[0], passes[k]), "grpc")
        title = "gRPC vs through the OpenAI gateway (first rate)"
    elif args.compare_in_process:  # passes: [gRPC at each rate..., in-process at each rate...]
        comparison = split_comparison(passes[0], passes[len(passes) // 2], args.temperature == 0)
        title = "gRPC services vs in-process (first rate)"
    report = {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "workload_resolved": {
                k: str(v) if isinstance(v, LengthRange) else v for k, v in vars(workload).items()
            },
            "request_rates": ["inf" if math.isinf(r) else r for r in rates],
        },
        "runs": runs,
        "comparison": comparison,
        "baselines": [],
    }
    args.result_file.write_text(json.dumps(report, indent=2) + "\n")  # again below, with baselines
    if not args.no_plot:
        write_plot(args.plot or args.result_file.with_suffix(".png"), runs, passes)

    subset = requests[: args.baseline_num_prompts]  # the very requests the first pass sent
    for name in args.baseline:
        print(f"bench: baseline {name} on {len(subset)} of {len(requests)} requests", file=sys.stderr)
        if name == "hf-static":
            result = run_hf_static(args.model, subset, args.baseline_batch_size, args.baseline_device)
        else:
            result = run_hf_cb(args.model, subset, args.baseline_device)
        report["baselines"].append(result)
        args.result_file.write_text(json.dumps(report, indent=2) + "\n")

    print(results_table(runs, comparison, title))
    if report["baselines"]:
        print()
        print(baseline_table(runs[0], report["baselines"], workload.num_prompts))
    print(f"\nresults: {args.result_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
