"""The `pagedserve` command: serve, scheduler, executor, generate, health, executors.

`pagedserve serve` is the embedded default: it starts one executor and one scheduler as two
processes on loopback (the same topology as docker-compose.yml) and stops both when either stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL_DIR = (
    Path(os.environ.get("PAGEDSERVE_HOME", Path.home() / ".cache" / "pagedserve")) / "default-model"
)


def ensure_default_model(directory: Path = DEFAULT_MODEL_DIR) -> Path:
    """Writes the built-in tiny model once (random weights, local tokenizer); no download."""
    if not (directory / "model.safetensors").exists():
        from pagedserve.tiny_model import write_tiny_model

        print(f"pagedserve: writing the built-in default model to {directory}", file=sys.stderr)
        write_tiny_model(directory)
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


# The batch limits and --max-model-len are defined by the executor's flags and go to both children.
SHARED_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens")


def forwarded_flags(
    args: argparse.Namespace, child: argparse.ArgumentParser, only: tuple[str, ...] | None = None
) -> list[str]:
    """`child`'s flags (those named in `only`, if given) as set in `args`, turned back into a
    command line: only values that differ from the child's defaults, so the child's own defaults
    stay the one source."""
    argv: list[str] = []
    for action in child._actions:
        if not action.option_strings or not hasattr(args, action.dest):
            continue
        if only is not None and action.dest not in only:
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
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--host", default="127.0.0.1", help="public address to bind")
    parser.add_argument("--port", type=int, default=50051, help="public gRPC port")
    parser.add_argument("--executor-port", type=int, default=None, help="internal port (default: port + 10)")
    for child in (executor_parser(), scheduler_parser()):
        for group in child._action_groups:
            actions = [a for a in group._group_actions if a.option_strings]
            if not actions:
                continue
            target = parser.add_argument_group(group.title)
            for action in actions:
                target._add_action(action)


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Builds both children's configs from `serve`'s flags, so a bad value is one argparse error
    here, before any model is written or process started (not a traceback from a child)."""
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.scheduler.service_config import ServiceConfig

    model = args.model or str(DEFAULT_MODEL_DIR)
    executor_port = args.executor_port or args.port + 10
    ExecutorConfig.from_args(args, parser=parser, model=model, host="127.0.0.1", port=executor_port)
    ServiceConfig.from_args(args, parser=parser, model=model)


def serve(args: argparse.Namespace) -> int:
    """Runs executor + scheduler as child processes until a signal or until one of them exits."""
    model = Path(args.model) if args.model else ensure_default_model()
    executor_port = args.executor_port or args.port + 10
    python = sys.executable
    executor_cmd = [
        python, "-m", "pagedserve.executor", "--model", str(model), "--host", "127.0.0.1",
        "--port", str(executor_port), *forwarded_flags(args, executor_parser()),
    ]  # fmt: skip
    scheduler_cmd = [
        python, "-m", "pagedserve.scheduler", "--model", str(model), "--host", args.host,
        "--port", str(args.port), "--executor", f"127.0.0.1:{executor_port}",
        *forwarded_flags(args, scheduler_parser()),
        *forwarded_flags(args, executor_parser(), only=SHARED_FLAGS),
    ]  # fmt: skip
    children = [subprocess.Popen(executor_cmd), subprocess.Popen(scheduler_cmd)]
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while not stopping and all(child.poll() is None for child in children):
        time.sleep(0.2)
    # The child that stopped first is why serve stops; the other one's code is our SIGTERM's.
    first = next((child for child in children if child.poll() is not None), None)
    for child in reversed(children):  # scheduler first, so clients get a clean shutdown
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + 15
    for child in reversed(children):
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
    if stopping or first is None:
        return 0
    code = first.returncode
    return 128 - code if code < 0 else code or 1  # killed by signal N: 128 + N, as a shell says


def generate(args: argparse.Namespace) -> int:
    """Streams one completion to stdout as its deltas arrive."""
    import grpc

    from pagedserve.client import make_request, stream

    request = make_request(
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
        try:
            for response in stream(channel, request, timeout=args.timeout):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    u = response.usage
                    print(
                        f"\n[finish={response.finish_reason} prompt_tokens={u.prompt_tokens} "
                        f"completion_tokens={u.completion_tokens} "
                        f"cached_prompt_tokens={u.cached_prompt_tokens}]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def health(args: argparse.Namespace) -> int:
    """Exit 0 when the service answers: the scheduler once attached, the executor once loaded."""
    import grpc

    from pagedserve.protos import executor_pb2, executor_pb2_grpc, generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
        try:
            if args.executor:
                executor_pb2_grpc.ExecutorStub(channel).GetStats(
                    executor_pb2.GetStatsRequest(), timeout=args.timeout
                )
            else:
                generation_pb2_grpc.GenerationStub(channel).GetModelInfo(
                    generation_pb2.GetModelInfoRequest(), timeout=args.timeout
                )
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="LLM serving with PagedAttention over gRPC"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve_parser = sub.add_parser("serve", help="executor + scheduler on loopback (the embedded default)")
    add_serve_args(serve_parser)
    sub.add_parser("scheduler", help="the scheduler service alone", add_help=False)
    sub.add_parser("executor", help="the executor service alone", add_help=False)
    sub.add_parser("bench", help="benchmark a server over gRPC (see `pagedserve bench -h`)", add_help=False)
    sub.add_parser("make-model", help="write a benchmark model directory (random weights)", add_help=False)

    gen = sub.add_parser("generate", help="stream one completion from a running server")
    gen.add_argument("prompt")
    gen.add_argument("--host", default="127.0.0.1")
    gen.add_argument("--port", type=int, default=50051)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=None)

    hc = sub.add_parser("health", help="exit 0 if the service answers")
    hc.add_argument("--host", default="127.0.0.1")
    hc.add_argument("--port", type=int, default=50051)
    hc.add_argument("--executor", action="store_true", help="probe an executor instead of a scheduler")
    hc.add_argument("--timeout", type=float, default=5.0)

    ex = sub.add_parser("executors", help="list a scheduler's executors (attached or not) as a table")
    ex.add_argument("--host", default="127.0.0.1")
    ex.add_argument("--port", type=int, default=50051, help="the scheduler's public port")
    ex.add_argument("--timeout", type=float, default=5.0)

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from pagedserve.bench import main as bench_main

        return bench_main(argv[1:])
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
    if args.command == "serve":
        check_serve_args(serve_parser, args)
    return {"serve": serve, "generate": generate, "health": health, "executors": executors}[args.command](
        args
    )


if __name__ == "__main__":
    sys.exit(main())
