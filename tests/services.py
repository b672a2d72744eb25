"""Starts the executor and scheduler as real processes on loopback, as docker-compose.yml does."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml

from pagedserve.bench.launch import free_port
from pagedserve.protos import (
    admin_pb2,
    admin_pb2_grpc,
    executor_pb2,
    executor_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)

REPO = Path(__file__).resolve().parent.parent


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}


COMPOSE_VARIABLE = re.compile(r"\$\{(\w+)(?:(:-|:\+)([^}]*))?\}")


def interpolate(text: str, env: Mapping[str, str] | None = None) -> str:
    """Compose's ${NAME}, ${NAME:-default} and ${NAME:+alternative}, with `env` (default: nothing set)."""
    env = env or {}

    def value(match: re.Match) -> str:
        name, op, word = match.group(1), match.group(2), match.group(3) or ""
        if op == ":-":
            return env.get(name) or word
        if op == ":+":
            return word if env.get(name) else ""
        return env.get(name, "")

    return COMPOSE_VARIABLE.sub(value, text)


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (!reset, !override) read as the plain values they tag."""


def _untagged(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> object:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


ComposeLoader.add_multi_constructor("!", _untagged)


def load_compose_file(name: str) -> dict:
    return yaml.load((REPO / name).read_text(), Loader=ComposeLoader)


def compose_commands(
    files: tuple[str, ...] = ("docker-compose.yml",), env: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """The `command` of each service in docker-compose.yml (then each override file in `files`,
    whose `command` replaces the one before, as Compose merges them), variables interpolated."""
    commands: dict[str, list[str]] = {}
    for name in files:
        spec = load_compose_file(name)
        for service, body in spec["services"].items():
            if "command" in (body or {}):
                commands[service] = [interpolate(arg, env) for arg in body["command"]]
    return commands


@functools.cache
def cli_flags(*command: str) -> frozenset[str]:
    """The flags `pagedserve COMMAND --help` lists (empty when the command does not exist): the
    feature check for flags that other branches add. In-process: the CLI's own parsers, no start-up."""
    from pagedserve.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([*command, "--help"])
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
    found = re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue())
    return frozenset(found) if code == 0 else frozenset()


# Flags docker-compose.yml passes that the scale-out and production branches add. Until they are
# merged, localize() leaves out the ones the local CLI lacks (so the other end-to-end tests keep
# running on compose's commands); tests/test_deploy.py says which are still missing.
PENDING_FLAGS = frozenset(
    {
        "--metrics-port",
        "--internal-token-file",
        "--lease-timeout",
        "--executor-refresh-interval",
        "--max-executors",
        "--shutdown-grace",
    }
)


def localize(
    command: list[str],
    model_dir: Path,
    port: int,
    executor_port: int | list[str],
    token_file: Path | None = None,
    scheduler_port: int | None = None,
) -> list[str]:
    """Maps a compose command onto this machine: the model path, loopback and free ports, the token
    file. `executor_port` is the one executor's port, or the scheduler's --executor flags to use
    instead of compose's dns:///executor:50061. Without `token_file` the token flag is left out
    (both tiers run open, as with PAGEDSERVE_INTERNAL_TOKEN unset). `scheduler_port`: where the
    gateway's dns:///scheduler:50051 points."""
    assert command[0] == "pagedserve"
    supported = cli_flags(command[1])
    out = [sys.executable, "-m", "pagedserve.cli", *command[1:2]]
    for arg in command[2:]:
        flag, _, value = arg.partition("=")
        if flag in PENDING_FLAGS and flag not in supported:
            continue
        if flag == "--model":
            arg = f"--model={model_dir}"
        elif flag == "--host":
            arg = "--host=127.0.0.1"
        elif flag == "--port":
            arg = f"--port={port}"
        elif flag == "--metrics-port":
            arg = f"--metrics-port={free_port()}"
        elif flag == "--internal-token-file":
            if token_file is None:
                continue
            arg = f"--internal-token-file={token_file}"
        elif flag == "--executor" and value == "dns:///executor:50061":
            if isinstance(executor_port, int):
                out.append(f"--executor=127.0.0.1:{executor_port}")
            else:
                out.extend(executor_port)
            continue
        elif flag == "--scheduler" and value == "dns:///scheduler:50051" and scheduler_port:
            arg = f"--scheduler=127.0.0.1:{scheduler_port}"  # the gateway's
        out.append(arg)
    return out


@dataclass
class Services:
    """Handles to a running executor + scheduler pair."""

    port: int
    executor_port: int
    executor: subprocess.Popen
    scheduler: subprocess.Popen
    log_dir: Path
    executor_cmd: list[str]
    env: dict[str, str] | None = None  # extra environment of both processes
    credentials: grpc.ChannelCredentials | None = None  # the public port's TLS; None: plaintext

    def channel(self) -> grpc.Channel:
        address = f"127.0.0.1:{self.port}"
        if self.credentials is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, self.credentials)

    def executor_stats(self) -> executor_pb2.ExecutorStats:
        with grpc.insecure_channel(f"127.0.0.1:{self.executor_port}") as ch:
            return executor_pb2_grpc.ExecutorStub(ch).GetStats(executor_pb2.GetStatsRequest(), timeout=10)

    def scheduler_log(self) -> str:
        return (self.log_dir / "scheduler.log").read_text(errors="replace")

    def executor_log(self) -> str:
        return (self.log_dir / "executor.log").read_text(errors="replace")

    def restart_executor(self) -> None:
        """Kills the executor (as a crash would) and starts a new one on the same port."""
        self.executor.kill()
        self.executor.wait(timeout=10)
        self.start_executor()

    def start_executor(self) -> None:
        """Starts the executor again (after it was killed or stopped) on the same port."""
        log = open(self.log_dir / "executor.log", "a")  # noqa: SIM115 - closed with the process
        self.executor = subprocess.Popen(
            self.executor_cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(self.env), cwd=REPO
        )


def wait_until_ready(services: Services, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with services.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while True:
            for proc, name in ((services.executor, "executor"), (services.scheduler, "scheduler")):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode}:\n{getattr(services, name + '_log')()}"
                    )
            try:
                stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=2)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"services not ready\n{services.executor_log()}\n{services.scheduler_log()}"
                    ) from None
                time.sleep(0.3)


@contextlib.contextmanager
def running_services(
    model_dir: Path,
    log_dir: Path,
    executor_args: tuple[str, ...] = (),
    scheduler_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[Services]:
    """Runs docker-compose.yml's two commands as processes (CPU, float32), plus extra flags and
    environment; `credentials` are the TLS a client of the public port needs."""
    commands = compose_commands()
    port, executor_port = free_port(), free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    cmds = {
        "executor": localize(commands["executor"], model_dir, executor_port, executor_port)
        + ["--device=cpu", "--dtype=float32", *executor_args],
        "scheduler": localize(commands["scheduler"], model_dir, port, executor_port) + list(scheduler_args),
    }
    procs = []
    try:
        for name, cmd in cmds.items():
            log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(env), cwd=REPO))
        services = Services(
            port, executor_port, procs[0], procs[1], log_dir, cmds["executor"], env, credentials
        )
        wait_until_ready(services)
        yield services
    finally:
        procs = [services.executor, services.scheduler] if "services" in locals() else procs
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def scheduler_stats(services: Services) -> admin_pb2.SchedulerStats:
    with services.channel() as ch:
        return admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetSchedulerStatsRequest(), timeout=10)


def wait_for_idle(services: Services, timeout: float = 20.0) -> admin_pb2.SchedulerStats:
    """Polls until no request is active, no GPU block is held (cached free blocks may stay) and no
    step is in flight (a step planned one ahead may still run after its requests finished)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = scheduler_stats(services)
        idle = (stats.gpu_blocks_in_use, stats.num_active_requests, stats.num_steps_in_flight) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def with_chat_template(model_dir: Path, directory: Path, template: str) -> Path:
    """A copy of the model directory whose tokenizer has `template` as its chat template (the tiny
    models have none)."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(model_dir, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return directory


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: Hugging Face greedy generation of one unpadded prompt."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def perturbed_copy(model_dir: Path, directory: Path, scale: float, seed: int = 0) -> Path:
    """The model with noise of `scale` times each matrix's std added: a draft that agrees with it
    often, not always (same tokenizer, same KV shape)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, directory)
    generator = torch.Generator().manual_seed(seed)
    for path in directory.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if t.dim() > 1:
                tensors[name] = t + scale * t.std() * torch.randn(t.shape, generator=generator)
        save_file(tensors, path, metadata={"format": "pt"})
    return directory
