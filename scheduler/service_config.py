"""Configuration of the scheduler service; CLI flags map onto it one to one (vLLM's names)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from pagedserve.common.flags import exit_bad_flags
from pagedserve.scheduler.discovery import parse_executor_target
from pagedserve.scheduler.router import ROUTING_POLICIES

DEFAULT_EXECUTOR = "127.0.0.1:50061"


@dataclass(frozen=True)
class ServiceConfig:
    """How the scheduler serves clients and drives its executors.

    Each executor decides its KV layout (block size, number of blocks) and reports it on attach;
    everything here is policy.
    """

    model: str  # model directory: the tokenizer is loaded from it
    # Executor addresses: host:port (one executor), or dns:///name:port (every address the name
    # resolves to, re-resolved every executor_refresh_interval seconds).
    executors: tuple[str, ...] = (DEFAULT_EXECUTOR,)
    executor_refresh_interval: float = 5.0
    max_executors: int | None = None  # the most executors held at once; None: no limit
    routing_policy: str = "prefix"
    host: str = "127.0.0.1"
    port: int = 50051
    served_model_name: str | None = None
    max_model_len: int | None = None  # None: the executor's
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    max_queue_len: int = 4096  # requests held (waiting + running) before RESOURCE_EXHAUSTED
    # Tokens per streamed message (the first token and the last always go at once). Each message
    # costs this process tens of microseconds; at hundreds of running requests, one per token can
    # take longer than the GPU's step and leave it waiting for the next plan.
    stream_interval: int = 1
    attach_timeout: float = 600.0  # seconds one Attach waits for its executor to come up (then retried)

    def __post_init__(self) -> None:
        if not isinstance(self.executors, tuple) or not self.executors:
            raise ValueError(f"executors must be a non-empty tuple of addresses, got {self.executors!r}")
        if len(set(self.executors)) != len(self.executors):
            twice = sorted({a for a in self.executors if self.executors.count(a) > 1})
            raise ValueError(f"the executor address {twice[0]!r} is given twice")
        for address in self.executors:
            parse_executor_target(address)  # ValueError naming what is wrong
        if not self.executor_refresh_interval > 0:
            raise ValueError(
                f"executor_refresh_interval must be positive, got {self.executor_refresh_interval}"
            )
        if self.max_executors is not None and self.max_executors < 1:
            raise ValueError(f"max_executors must be positive (or unset: no limit), got {self.max_executors}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}")
        if not self.attach_timeout > 0:
            raise ValueError(f"attach_timeout must be positive, got {self.attach_timeout}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be positive, got {self.max_queue_len}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be positive, got {self.stream_interval}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, shared_only: bool = False) -> None:
        """Adds the scheduler's flags. With shared_only, only those of the scheduler alone: `pagedserve
        serve` adds model, host and port itself and takes the batch limits from the executor's flags
        (the same names and defaults), forwarding them to both."""
        group = parser.add_argument_group("scheduler")
        if not shared_only:
            group.add_argument("--model", required=True, help="model directory (tokenizer files)")
            group.add_argument("--host", default="127.0.0.1")
            group.add_argument("--port", type=int, default=50051, help="public gRPC port")
            group.add_argument("--max-model-len", type=int, default=None)
            group.add_argument("--max-num-seqs", type=int, default=256)
            group.add_argument("--max-num-batched-tokens", type=int, default=8192)
            group.add_argument(
                "--executor", dest="executors", action="append", default=None, metavar="ADDR",
                help="executor host:port, or dns:///name:port for every address the name resolves to; "
                f"repeatable (default: {DEFAULT_EXECUTOR})",
            )  # fmt: skip
            group.add_argument("--attach-timeout", type=float, default=600.0)
        group.add_argument(
            "--executor-refresh-interval", type=float, default=5.0,
            help="seconds between re-resolutions of dns:/// executor names and retries of refused executors",
        )  # fmt: skip
        group.add_argument(
            "--max-executors", type=int, default=None,
            help="the most executors attached at once (default: no limit); the others stay as spares",
        )  # fmt: skip
        group.add_argument(
            "--routing-policy", choices=ROUTING_POLICIES, default="prefix",
            help="how a request picks its executor: exact prefix-cache hit against load (default), "
            "round_robin, or least_loaded",
        )  # fmt: skip
        group.add_argument("--served-model-name", default=None)
        group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        group.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
        group.add_argument("--max-queue-len", type=int, default=4096)
        group.add_argument(
            "--stream-interval", type=int, default=1,
            help="tokens per streamed message (first and last token are sent at once)",
        )  # fmt: skip

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, *, parser: argparse.ArgumentParser | None = None, **overrides
    ) -> ServiceConfig:
        """The config of parsed `add_cli_args` flags (`overrides` win). An invalid value is a bad
        flag: it ends the program as argparse would (through `parser.error`, else "pagedserve
        scheduler: error: ..."; exit 2), naming the flags, not with a traceback."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        if values.get("executors") is None:  # --executor not given: the default address
            values.pop("executors", None)
        elif isinstance(values["executors"], list):
            values["executors"] = tuple(values["executors"])
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as exc:
            flags = [name for name in values if name not in overrides]
            exit_bad_flags(str(exc), flags, parser, "pagedserve scheduler")
