"""The `pagedserve` command: serve, scheduler, executor, openai, generate, health, executors, bench,
plan, tune.

`pagedserve serve` is the embedded default: it starts `--data-parallel-size` executors and one
scheduler as processes on loopback (the same topology as docker-compose.yml), restarts an executor
that dies, and stops everything when the scheduler stops (see pagedserve.supervisor).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.common.default_model import DEFAULT_MODEL_DIR, resolve_model

if TYPE_CHECKING:
    from pagedserve.supervisor import ChildSpec


def ensure_default_model(directory: Path = DEFAULT_MODEL_DIR) -> Path:
    """The built-in model's directory (trained weights shipped as package data; no download).

    The random-weight tiny model that used to be written here is `pagedserve.tiny_model`, for tests
    and benchmarks that want one."""
    if not (directory / "config.json").exists():
        raise FileNotFoundError(
            f"the built-in model is missing from {directory}: reinstall pagedserve (it is package data)"
        )
    return directory


def executor_parser() -> argparse.ArgumentParser:
    """The executor's own flags, less the endpoint ones `serve` sets for it (--model/--host/--port)."""
    from pagedserve.executor.config import add_cli_args

    return add_cli_args(argparse.ArgumentParser(add_help=False), endpoint=False)


def scheduler_parser() -> argparse.ArgumentParser:
    """The scheduler's own flags, less the endpoint ones and those the executor also takes (the
    batch limits: `serve` forwards them to both)."""
    from pagedserve.scheduler.service_config import ServiceConfig

    parser = argparse.ArgumentParser(add_help=False)
    ServiceConfig.add_cli_args(parser, shared_only=True)
    return parser


# How long a child may take to exit after SIGTERM (the scheduler: its --shutdown-grace on top).
CHILD_STOP_MARGIN_S = 15.0

# The batch limits, --max-model-len and the internal token file are defined by the executor's flags
# and go to both children.
SHARED_FLAGS = (
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "internal_token_file",
    "speculative_config",
)


def forwarded_flags(
    args: argparse.Namespace,
    child: argparse.ArgumentParser,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
) -> list[str]:
    """`child`'s flags (those named in `only`, if given; not those in `skip`) as set in `args`,
    turned back into a command line: only values that differ from the child's defaults, so the
    child's own defaults stay the one source."""
    argv: list[str] = []
    for action in child._actions:
        if not action.option_strings or not hasattr(args, action.dest):
            continue
        if (only is not None and action.dest not in only) or action.dest in skip:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            flag = action.option_strings[0 if value else 1]
            argv.append(flag)
        elif isinstance(action, argparse._StoreTrueAction):
            argv.append(action.option_strings[0])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`serve`'s own flags, then the executor's and the scheduler's, taken from their definitions."""
    parser.add_argument(
        "--model",
        type=resolve_model,
        default="",
        help="model directory (default or empty: the built-in model)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="public address to bind")
    parser.add_argument("--port", type=int, default=50051, help="public gRPC port")
    parser.add_argument(
        "--executor-port",
        type=int,
        default=None,
        help="internal port of the first executor; executor i listens on it + i (default: port + 10)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="executors behind the one scheduler, each with its own model copy and KV pool "
        "(default 1). On CUDA with at least this many GPUs visible, executor i gets GPU i alone "
        "(CUDA_VISIBLE_DEVICES); with fewer GPUs (G), executor i gets GPU i mod G and its "
        "--gpu-memory-utilization is the flag's value divided by the number of executors on that "
        "GPU (they start one after another). On the CPU each gets cores/N threads. With "
        "--tensor-parallel-size T, executor i gets GPUs i*T..i*T+T-1 (N*T GPUs needed).",
    )
    parser.add_argument(
        "--openai-port", type=int, default=None, help="also start the OpenAI-compatible gateway on this port"
    )
    parser.add_argument(
        "--executor-metrics-port", type=int, default=None,
        help="the first executor's --metrics-port; executor i serves on it + i "
        "(default: --metrics-port + 1 when that is given)",
    )  # fmt: skip
    seen: set[str] = set()
    for child in (executor_parser(), scheduler_parser()):
        for group in child._action_groups:
            # A flag both children define (--metrics-port) is added once; serve tells them apart.
            actions = [a for a in group._group_actions if a.option_strings and a.dest not in seen]
            seen.update(a.dest for a in actions)
            if not actions:
                continue
            target = parser.add_argument_group(group.title)
            for action in actions:
                target._add_action(action)


def executor_metrics_port(args: argparse.Namespace) -> int | None:
    """In `serve`, --metrics-port is the scheduler's; the executor's is the next port up, unless
    --executor-metrics-port says otherwise."""
    if args.executor_metrics_port is not None:
        return args.executor_metrics_port
    return args.metrics_port + 1 if args.metrics_port is not None else None


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Builds both children's configs from `serve`'s flags, so a bad value is one argparse error
    here, before any model is written or process started (not a traceback from a child)."""
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.scheduler.service_config import ServiceConfig

    model = args.model
    executor_port = args.executor_port or args.port + 10
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if executor_port + args.data_parallel_size - 1 > 65535:
        parser.error(f"--executor-port {executor_port} + --data-parallel-size leaves the port range")
    ExecutorConfig.from_args(
        args,
        parser=parser,
        model=model,
        host="127.0.0.1",
        port=executor_port,
        metrics_port=executor_metrics_port(args),
    )
    ServiceConfig.from_args(args, parser=parser, model=model)
    if args.tensor_parallel_size > 1:  # enough GPUs for every executor's group
        from pagedserve.supervisor import place_executors, visible_gpu_count

        try:
            place_executors(
                args.data_parallel_size, base_port=executor_port, gpu_memory_utilization=1.0,
                num_gpus=visible_gpu_count(args.device), tensor_parallel_size=args.tensor_parallel_size,
            )  # fmt: skip
        except ValueError as exc:
            parser.error(str(exc))
    if args.openai_port is not None and not 0 < args.openai_port < 65536:
        parser.error(f"--openai-port must be in 1..65535, got {args.openai_port}")


def health_status(address: str, service: str, timeout: float) -> str:
    """The grpc.health.v1 status name the server at `address` reports for `service` (open even
    where an internal token guards the executor's other RPCs). Raises grpc.RpcError."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _executor_ready(port: int) -> bool:
    """Whether the executor on `port` has loaded its model and serves."""
    import grpc

    from pagedserve.protos import wire

    try:
        return health_status(f"127.0.0.1:{port}", wire.EXECUTOR_HEALTH_SERVICE, timeout=2) == "SERVING"
    except grpc.RpcError:
        return False


def serve_children(args: argparse.Namespace, model: Path) -> list[ChildSpec]:
    """The processes of `serve`: the executors (restarted when they die; see place_executors for
    their GPUs), then the scheduler with one --executor per executor."""
    from pagedserve.supervisor import ChildSpec, place_executors, visible_gpu_count

    python = sys.executable
    placements = place_executors(
        args.data_parallel_size,
        base_port=args.executor_port or args.port + 10,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpus=visible_gpu_count(args.device),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        tensor_parallel_size=args.tensor_parallel_size,
    )
    executor_flags = forwarded_flags(args, executor_parser(), skip=("metrics_port",))
    first_metrics_port = executor_metrics_port(args)
    children = []
    for p in placements:
        utilization = []
        if p.gpu_memory_utilization != args.gpu_memory_utilization:  # the last flag wins
            utilization = ["--gpu-memory-utilization", f"{p.gpu_memory_utilization:.4f}"]
        argv = [
            python, "-m", "pagedserve.executor", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(p.port), *executor_flags, *utilization,
        ]  # fmt: skip
        if first_metrics_port is not None:
            argv += ["--metrics-port", str(first_metrics_port + p.index)]
        ready = (lambda port=p.port: _executor_ready(port)) if p.shares_gpu else None
        children.append(ChildSpec(f"executor-{p.index}", argv, p.env, restart=True, ready=ready))
    scheduler_argv = [
        python, "-m", "pagedserve.scheduler", "--model", str(model), "--host", args.host,
        "--port", str(args.port),
        *(arg for p in placements for arg in ("--executor", f"127.0.0.1:{p.port}")),
        *forwarded_flags(args, scheduler_parser()),
        *forwarded_flags(args, executor_parser(), only=SHARED_FLAGS),
    ]  # fmt: skip
    # The scheduler drains its streams (up to --shutdown-grace) on SIGTERM, while the executors run.
    children.append(ChildSpec("scheduler", scheduler_argv, stop_grace_s=args.shutdown_grace))
    gateway_argv = openai_gateway_command(args, model)
    if gateway_argv:  # in front of the scheduler, restarted like the executors
        children.append(ChildSpec("openai", gateway_argv, restart=True))
    return children


def serve(args: argparse.Namespace) -> int:
    """Runs the executors and the scheduler as child processes until a signal or until the
    scheduler exits (then with its status); executors that die are restarted."""
    from pagedserve.common.logs import configure_logging
    from pagedserve.supervisor import Supervisor, install_stop_handlers

    configure_logging("serve")
    model = Path(args.model)
    if model == DEFAULT_MODEL_DIR:
        ensure_default_model(model)
    stopping = install_stop_handlers()
    supervisor = Supervisor(serve_children(args, model))
    try:
        status = supervisor.start(stopping)
        if status is None:
            status = supervisor.run(stopping)
    finally:
        supervisor.stop(CHILD_STOP_MARGIN_S)
    return 0 if status is None else status


def openai_gateway_command(args: argparse.Namespace, model: Path) -> list[str] | None:
    """`serve --openai-port P`: the gateway as one more child, in front of serve's scheduler."""
    if args.openai_port is None:
        return None
    return [
        sys.executable, "-m", "pagedserve.entrypoints.openai", "--host", args.host,
        "--port", str(args.openai_port), "--scheduler", f"127.0.0.1:{args.port}", "--tokenizer", str(model),
    ]  # fmt: skip


# `generate`'s own defaults for request fields (the service's default for max_tokens is "up to
# max_model_len": too long to stream to a terminal by surprise).
GENERATE_DEFAULTS = {"max_tokens": "64"}


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    """`generate`'s flags: the endpoint, the prompt, and one flag per request field that has one
    (declared with the field, pagedserve.common.validation). The flags take words, which the one
    validation reads as values (`Rule.from_text`), so what is refused is refused with the message
    every door gives."""
    from pagedserve.common.validation import FIELDS

    parser.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    parser.add_argument(
        "--prompt-token-ids", default=None, metavar="IDS",
        help="the prompt as token ids (comma-separated), instead of a text",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="the scheduler's address")
    parser.add_argument("--port", type=int, default=50051, help="the scheduler's public port")
    parser.add_argument("--timeout", type=float, default=None, help="the call's deadline in seconds")
    for name, spec in FIELDS.items():
        if spec.flag is None:
            continue
        rule = spec.rule
        help_text = f"{spec.doc} ({rule.describe()})".replace("%", "%%")
        if rule.cli_action == "store_true":
            parser.add_argument(spec.flag, dest=name, action="store_true", help=help_text)
        else:
            default = GENERATE_DEFAULTS.get(name)
            if default is not None:
                help_text += f"; default {default}"
            if rule.cli_action == "append":
                help_text += "; the flag may be repeated"
            parser.add_argument(spec.flag, dest=name, action=rule.cli_action, default=default, help=help_text)


def generate_request(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The GenerateRequest `generate`'s flags spell; a refusal is a usage error (exit status 2)."""
    from pagedserve.common.validation import FIELDS, InvalidRequest, to_proto, validate_request

    if args.prompt is not None and args.prompt_token_ids is not None:
        parser.error("prompt: give it as a text or as --prompt-token-ids, not both")
    values = {name: getattr(args, name) for name, spec in FIELDS.items() if spec.flag is not None}
    values["prompt"] = args.prompt  # None (neither given) is refused in its turn
    if args.prompt_token_ids is not None:  # read as ids here: the prompt's rule would take a text
        values["prompt"] = FIELDS["stop_token_ids"].rule.from_text(args.prompt_token_ids)
    try:
        return to_proto(validate_request(values, from_text=True))
    except InvalidRequest as exc:
        parser.error(f"{_flag(exc.field, args)}: {exc.reason}")


def _flag(field: str, args: argparse.Namespace) -> str:
    """How the command line named a request field."""
    from pagedserve.common.validation import FIELDS

    if field == "prompt":
        return "--prompt-token-ids" if args.prompt_token_ids is not None else "prompt"
    spec = FIELDS.get(field)
    return spec.flag if spec is not None and spec.flag else field


def generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Streams one completion to stdout as its deltas arrive. A request the scheduler refuses
    (INVALID_ARGUMENT) is a usage error as the flags' own are (exit 2); other failures exit 1."""
    import grpc

    from pagedserve.client import stream
    from pagedserve.common.validation import field_named
    from pagedserve.protos import generation_pb2

    request = generate_request(parser, args)
    logprob = 0.0
    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
        try:
            for response in stream(channel, request, timeout=args.timeout):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                logprob += sum(response.logprobs)
                if response.finish_reason:
                    u = response.usage
                    reason = generation_pb2.FinishReason.Name(response.finish_reason)
                    logprobs = f" cumulative_logprob={logprob:.4f}" if request.return_logprobs else ""
                    print(
                        f"\n[finish={reason.removeprefix('FINISH_REASON_').lower()} "
                        f"prompt_tokens={u.prompt_tokens} "
                        f"completion_tokens={u.completion_tokens} "
                        f"cached_prompt_tokens={u.cached_prompt_tokens}{logprobs}]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as exc:
            details = exc.details() or ""
            field = field_named(details)
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and field is not None:
                parser.error(f"{_flag(field, args)}{details[len(field) :]}")
            print(f"\nerror: {exc.code().name}: {details}", file=sys.stderr)
            return 1
    return 0


def health(args: argparse.Namespace) -> int:
    """grpc.health.v1 Check of the scheduler (SERVING while an executor is attached) or of the
    executor (SERVING once its model is loaded): prints the status, exit 0 on SERVING, else 1."""
    import grpc

    from pagedserve.protos import wire

    service = wire.EXECUTOR_HEALTH_SERVICE if args.executor else wire.SCHEDULER_HEALTH_SERVICE
    try:
        status = health_status(f"{args.host}:{args.port}", service, args.timeout)
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"unhealthy: {status}", file=sys.stderr)
        return 1
    print(status)
    return 0


EXECUTOR_COLUMNS = (
    ("address", "address"),
    ("state", "state"),
    ("epoch", "lease_epoch"),
    ("running", "num_running"),
    ("waiting", "num_waiting"),
    ("blocks used", "gpu_blocks_in_use"),
    ("blocks", "num_gpu_blocks"),
    ("routed", "requests_routed"),
    ("prefix hit tokens", "prefix_cache_hit_tokens"),
    ("cpu tier blocks", "cpu_tier_blocks"),
    ("cpu tier hit tokens", "cpu_prefix_cache_hit_tokens"),
    ("disk tier blocks", "disk_tier_blocks"),
)


def executors(args: argparse.Namespace) -> int:
    """Prints a scheduler's executors (Admin.ListExecutors) as a markdown table."""
    import grpc

    from pagedserve.common.tables import markdown_table
    from pagedserve.protos import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
        try:
            reply = admin_pb2_grpc.AdminStub(channel).ListExecutors(
                admin_pb2.ListExecutorsRequest(), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    rows = [[getattr(e, field) for _, field in EXECUTOR_COLUMNS] for e in reply.executors]
    print(markdown_table([name for name, _ in EXECUTOR_COLUMNS], rows))
    return 0


def build_parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    """The `pagedserve` command's parser. `serve`, `generate`, `health` and `executors` are parsed
    here; the other commands own their parsers (see `command_parsers`) and only have a stub here,
    so that `pagedserve -h` lists them.

    `serve_flags=False` leaves `serve`'s own flags out: they come from the executor's config, which
    imports torch (seconds), and the other commands (`generate`) should start at once."""
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="LLM serving with PagedAttention over gRPC"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve_parser = sub.add_parser("serve", help="executor + scheduler on loopback (the embedded default)")
    if serve_flags:
        add_serve_args(serve_parser)
    sub.add_parser("scheduler", help="the scheduler service alone", add_help=False)
    sub.add_parser("executor", help="the executor service alone", add_help=False)
    sub.add_parser("bench", help="benchmark a server over gRPC (see `pagedserve bench -h`)", add_help=False)
    sub.add_parser("make-model", help="write a benchmark model directory (random weights)", add_help=False)
    sub.add_parser(
        "openai", help="OpenAI-compatible HTTP gateway (see `pagedserve openai -h`)", add_help=False
    )
    sub.add_parser(
        "plan",
        help="KV-cache memory of a deployment before it starts (see `pagedserve plan -h`)",
        add_help=False,
    )
    sub.add_parser(
        "tune", help="replay a request log over a grid of settings and recommend one", add_help=False
    )

    gen = sub.add_parser("generate", help="stream one completion from a running server")
    add_generate_args(gen)

    hc = sub.add_parser("health", help="grpc.health.v1 check: exit 0 if the service is SERVING")
    hc.add_argument("--host", default="127.0.0.1", help="the service's address")
    hc.add_argument("--port", type=int, default=50051, help="its gRPC port (an executor's: 50061)")
    hc.add_argument("--executor", action="store_true", help="probe an executor instead of a scheduler")
    hc.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")

    ex = sub.add_parser("executors", help="list a scheduler's executors (attached or not) as a table")
    ex.add_argument("--host", default="127.0.0.1", help="the scheduler's address")
    ex.add_argument("--port", type=int, default=50051, help="the scheduler's public port")
    ex.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser, by the words that run it (what `pagedserve WORDS --help` prints).
    The documentation's flag reference is generated from these (scripts/docs_reference.py)."""
    from pagedserve.bench.cli import build_parser as bench_parser
    from pagedserve.bench.loglik import build_parser as loglik_parser
    from pagedserve.entrypoints.openai.api_server import build_parser as openai_parser
    from pagedserve.executor.__main__ import build_parser as executor_service_parser
    from pagedserve.model_shapes import build_parser as make_model_parser
    from pagedserve.plan import build_parser as plan_parser
    from pagedserve.scheduler.__main__ import build_parser as scheduler_service_parser
    from pagedserve.tune import build_parser as tune_parser

    sub = _subparsers(build_parser())
    return {
        "serve": sub["serve"],
        "scheduler": scheduler_service_parser(),
        "executor": executor_service_parser(),
        "openai": openai_parser(),
        "generate": sub["generate"],
        "health": sub["health"],
        "executors": sub["executors"],
        "bench": bench_parser(),
        "bench --log-likelihood": loglik_parser(),
        "make-model": make_model_parser(),
        "plan": plan_parser(),
        "tune": tune_parser(),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(serve_flags=argv[:1] == ["serve"])
    if argv and argv[0] == "bench":
        from pagedserve.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "openai":
        from pagedserve.entrypoints.openai.api_server import main as openai_main

        return openai_main(argv[1:])
    if argv and argv[0] == "plan":
        from pagedserve.plan import main as plan_main

        return plan_main(argv[1:])
    if argv and argv[0] == "tune":
        from pagedserve.tune import main as tune_main

        return tune_main(argv[1:])
    if argv and argv[0] == "make-model":
        from pagedserve.model_shapes import main as make_model_main

        return make_model_main(argv[1:])
    if argv and argv[0] in ("scheduler", "executor"):  # their own parsers own their flags
        if argv[0] == "scheduler":
            from pagedserve.scheduler.__main__ import main as scheduler_main

            scheduler_main(argv[1:])
        else:
            from pagedserve.executor.__main__ import main as executor_main

            executor_main(argv[1:])
        return 0
    args = parser.parse_args(argv)
    commands = _subparsers(parser)
    if args.command == "serve":
        check_serve_args(commands["serve"], args)
    if args.command == "generate":
        return generate(args, commands["generate"])
    return {"serve": serve, "health": health, "executors": executors}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
