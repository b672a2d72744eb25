"""Configuration of the scheduler service; CLI flags map onto it one to one (vLLM's names)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from pagedserve.common.default_model import resolve_model
from pagedserve.common.flags import exit_bad_flags


@dataclass(frozen=True)
class ServiceConfig:
    """How the scheduler serves clients and drives its executor.

    The executor decides the KV layout (block size, number of blocks) and reports it on attach;
    everything here is policy.
    """

    model: str  # model directory: the tokenizer is loaded from it
    executor: str = "127.0.0.1:50061"  # executor address, host:port
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
    attach_timeout: float = 600.0  # seconds to wait for the executor at startup

    def __post_init__(self) -> None:
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
            group.add_argument(
                "--model", type=resolve_model, default="",
                help="model directory, for its tokenizer (default or empty: the built-in model)",
            )  # fmt: skip
            group.add_argument("--host", default="127.0.0.1")
            group.add_argument("--port", type=int, default=50051, help="public gRPC port")
            group.add_argument("--max-model-len", type=int, default=None)
            group.add_argument("--max-num-seqs", type=int, default=256)
            group.add_argument("--max-num-batched-tokens", type=int, default=8192)
            group.add_argument("--executor", default="127.0.0.1:50061", help="executor host:port")
            group.add_argument("--attach-timeout", type=float, default=600.0)
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
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as exc:
            flags = [name for name in values if name not in overrides]
            exit_bad_flags(str(exc), flags, parser, "pagedserve scheduler")
