"""Configuration of the scheduler service; CLI flags map onto it one to one (vLLM's names)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from pagedserve.common.default_model import resolve_model
from pagedserve.common.flags import exit_bad_flags
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.common.tls import ChannelTls, ServerTls
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
    # Per-client rate (requests per second, by x-client-id or peer address); None: off. See throttle.py.
    client_rate_limit: int | None = None
    # The token sent to the executor (PAGEDSERVE_INTERNAL_TOKEN when unset); see common/auth.py.
    internal_token_file: str | None = None
    # TLS of the public port (vLLM's names); ssl_ca_certs requires client certificates (mTLS).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    # TLS of the channel to the executor: the roots its certificate is checked against, and a
    # client certificate for an executor that requires one. Any of them switches the channel to TLS.
    executor_ssl_ca_certs: str | None = None
    executor_ssl_certfile: str | None = None
    executor_ssl_keyfile: str | None = None
    metrics_port: int | None = None  # Prometheus /metrics over HTTP on --host; None: not served
    # On SIGTERM, how long running streams may take to finish before they end with UNAVAILABLE.
    shutdown_grace: float = 30.0
    # One JSON line per finished request (scheduler.request_log); the text too with request_log_text.
    request_log: str | None = None
    request_log_text: bool = False
    # Speculative decoding (docs/speculative-decoding.md): a SpeculativeConfig, or its JSON text or
    # dict (the flag's value; made a SpeculativeConfig here). None: off.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # JSON text or a dict: ValueError naming the field
            spec = SpeculativeConfig.parse(self.speculative_config)  # type: ignore[arg-type]
            object.__setattr__(self, "speculative_config", spec)
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
        if self.client_rate_limit is not None and self.client_rate_limit < 1:
            raise ValueError(f"client_rate_limit must be positive (requests/s), got {self.client_rate_limit}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 1..65535, got {self.metrics_port}")
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(f"metrics_port must differ from port ({self.port})")
        if self.request_log_text and not self.request_log:
            raise ValueError("request_log_text needs request_log (the file to write)")
        if self.request_log is not None and not self.request_log:
            raise ValueError("request_log must name a file")
        if not self.shutdown_grace >= 0:
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")
        self.server_tls()  # TlsConfigError (a ValueError) for files that do not go together
        self.executor_channel_tls()

    def server_tls(self) -> ServerTls | None:
        """The TLS of the public port (None: plaintext)."""
        return ServerTls.from_flags(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)

    def executor_channel_tls(self) -> ChannelTls | None:
        """The TLS of the channel to the executor (None: plaintext)."""
        files = (self.executor_ssl_ca_certs, self.executor_ssl_certfile, self.executor_ssl_keyfile)
        return None if files == (None, None, None) else ChannelTls(*files)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, shared_only: bool = False) -> None:
        """Adds the scheduler's flags. With shared_only, only those of the scheduler alone: `pagedserve
        serve` adds model, host and port itself and takes the batch limits and --internal-token-file
        from the executor's flags (the same names and defaults), forwarding them to both; its
        executor listens on loopback without TLS, so the --executor-ssl-* flags are left out too."""
        group = parser.add_argument_group("scheduler")
        if not shared_only:
            group.add_argument(
                "--model", type=resolve_model, default="",
                help="model directory, for its tokenizer (default or empty: the built-in model)",
            )  # fmt: skip
            group.add_argument("--host", default="127.0.0.1", help="address to bind")
            group.add_argument("--port", type=int, default=50051, help="public gRPC port")
            group.add_argument(
                "--max-model-len", type=int, default=None,
                help="longest prompt + completion (default: the executors')",
            )  # fmt: skip
            group.add_argument(
                "--max-num-seqs",
                type=int,
                default=256,
                help="running sequences per step (within the executor's)",
            )
            group.add_argument(
                "--max-num-batched-tokens",
                type=int,
                default=8192,
                help="tokens per step (the chunked-prefill budget)",
            )
            group.add_argument(
                "--speculative-config", default=None, metavar="JSON",
                help='speculative decoding, vLLM\'s shape: {"method": "ngram", "num_speculative_tokens": '
                'K, "prompt_lookup_max": N, "prompt_lookup_min": M} or {"method": "draft_model", '
                '"model": DIR, "num_speculative_tokens": K}, optionally "disable_by_batch_size": B '
                "(the executor takes the same flag; default: off)",
            )  # fmt: skip
            group.add_argument(
                "--executor", dest="executors", action="append", default=None, metavar="ADDR",
                help="executor host:port, or dns:///name:port for every address the name resolves to; "
                f"repeatable (default: {DEFAULT_EXECUTOR})",
            )  # fmt: skip
            group.add_argument(
                "--attach-timeout", type=float, default=600.0,
                help="seconds one Attach waits for its executor to come up before it is retried",
            )  # fmt: skip
            group.add_argument(
                "--internal-token-file",
                default=None,
                help="file with the token sent to the executor (default: $PAGEDSERVE_INTERNAL_TOKEN)",
            )
            group.add_argument(
                "--executor-ssl-ca-certs",
                default=None,
                help="PEM CAs of the executor's certificate; the executor channel uses TLS",
            )
            group.add_argument(
                "--executor-ssl-certfile", default=None, help="PEM client certificate for an mTLS executor"
            )
            group.add_argument("--executor-ssl-keyfile", default=None, help="key of --executor-ssl-certfile")
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
        group.add_argument(
            "--served-model-name", default=None,
            help="the model name GetModelInfo and the metrics report (default: the model directory)",
        )  # fmt: skip
        group.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
            help="reuse the KV blocks of common prompt prefixes",
        )  # fmt: skip
        group.add_argument(
            "--preemption-mode", choices=("recompute", "swap"), default="recompute",
            help="a pre-empted sequence's KV: freed and recomputed later, or swapped to the CPU pool",
        )  # fmt: skip
        group.add_argument(
            "--max-queue-len", type=int, default=4096,
            help="requests held before new ones get RESOURCE_EXHAUSTED (also a client's rate-limit backlog)",
        )  # fmt: skip
        group.add_argument(
            "--stream-interval", type=int, default=1,
            help="tokens per streamed message (first and last token are sent at once)",
        )  # fmt: skip
        group.add_argument(
            "--client-rate-limit",
            type=int,
            default=None,
            help="requests per second per client (x-client-id metadata, else peer address); default off",
        )
        group.add_argument("--ssl-certfile", default=None, help="serve TLS with this PEM certificate")
        group.add_argument("--ssl-keyfile", default=None, help="the PEM private key of --ssl-certfile")
        group.add_argument(
            "--ssl-ca-certs", default=None, help="require client certificates signed by these PEM CAs (mTLS)"
        )
        group.add_argument(
            "--metrics-port", type=int, default=None,
            help="serve Prometheus metrics over HTTP on this port (default: not served)",
        )  # fmt: skip
        group.add_argument(
            "--request-log", default=None, metavar="FILE",
            help="append one JSON line per finished request to FILE (arrival, lengths, priority, finish "
            "reason, TTFT, the prompt's block-hash chain; no text), for `pagedserve plan/tune --traffic`",
        )  # fmt: skip
        group.add_argument(
            "--request-log-text", action="store_true",
            help="also write each request's prompt and output text into --request-log",
        )  # fmt: skip
        group.add_argument(
            "--shutdown-grace", type=float, default=30.0,
            help="seconds running streams get to finish on SIGTERM before they end with UNAVAILABLE",
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
