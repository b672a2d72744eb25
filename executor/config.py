"""Executor configuration: one frozen dataclass, validated at construction, and its CLI flags.

Flag names follow vLLM (`--gpu-memory-utilization`, `--max-model-len`, ...) so operators can reuse
what they know. `add_cli_args` and `ExecutorConfig.from_args` are shared with the `pagedserve` CLI.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

import torch

from pagedserve.common.default_model import resolve_model
from pagedserve.common.flags import exit_bad_flags
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.common.tls import ServerTls, TlsConfigError
from pagedserve.executor.lease import DEFAULT_LEASE_TIMEOUT_S

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")  # vLLM's names: read the checkpoint, or random weights
QUANTIZATIONS = (None, "fp8")  # = executor.quantization's (not imported: this module stays light)
KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_PORT = 50061
_GIB = 1 << 30


@dataclass(frozen=True)
class ExecutorConfig:
    """Everything an executor needs to start; invalid values raise ValueError at construction.

    Attributes:
        model: directory of a Hugging Face checkpoint (config.json + safetensors).
        host, port: where the gRPC server listens.
        dtype: weights and KV dtype; "auto" = float32 on CPU, bfloat16 on CUDA.
        device: "auto" picks CUDA when available.
        max_model_len: longest sequence (prompt + output); None = the model's max_position_embeddings.
        block_size: tokens per KV block (a multiple of 16, what the kernels tile by).
        gpu_memory_utilization: fraction of total GPU memory the executor may use (weights,
            activations and KV pool together).
        num_gpu_blocks_override: fixes the size of the device KV pool, skipping the sizing.
        swap_space: GiB of CPU memory for the swap pool.
        kv_offloading_size: GiB of CPU memory for the prefix cache's CPU tier (0: none); with the
            swap pool it is one pinned host pool (executor.kv_cache, scheduler.kv_tier).
        kv_offloading_disk: a directory for the disk tier below the CPU tier (None: none); the
            executor keeps its blocks in one unlinked file there (executor.disk_tier).
        kv_offloading_disk_size: GiB of that directory's disk for the disk tier.
        cpu_kv_cache_space: GiB of the device KV pool when the device is the CPU.
        max_num_batched_tokens: most tokens in one step; the profiling pass runs this many.
        max_num_seqs: most sequences in one step.
        enforce_eager: run every step eagerly; otherwise steps on CUDA replay CUDA graphs captured
            at startup, per padded batch size (decode) or token count (mixed; see executor.cuda_graphs).
        step_trace: file to write one JSON line of timing per step to (see executor.step_trace).
        lease_timeout: seconds a scheduler's lease stays live without a step or a heartbeat; then
            the executor frees everything and accepts another scheduler (see executor.lease).
        internal_token_file: file holding the token every RPC must carry (PAGEDSERVE_INTERNAL_TOKEN
            when unset; neither: open). See pagedserve.common.auth.
        ssl_certfile, ssl_keyfile: serve TLS only, with this certificate and key.
        ssl_ca_certs: also require client certificates signed by these CAs (mTLS).
        load_format: "auto" reads the checkpoint's safetensors; "dummy" fills the weights with random
            numbers instead (config.json and the tokenizer are still read): for benchmarks of shapes
            whose checkpoint is too big to write (`pagedserve make-model --no-weights`).
        quantization: None, or "fp8": e4m3 weights with per-channel scales (quantized at load, or
            an FP8 checkpoint as is) and per-token activations (see executor.quantization).
        kv_cache_dtype: "auto" (the model dtype) or "fp8" (e4m3 with per-layer scales: about twice
            the blocks in the same memory).
        metrics_port: serve Prometheus metrics over HTTP on this port (on `host`); None: not served.
        tensor_parallel_size: devices one executor spans (vLLM's name): this process is rank 0
            and starts N - 1 worker processes; on CUDA rank r uses GPU (current device + r). See
            executor.parallel and executor.tp_workers.
        disable_hybrid_kv_cache_manager: give every layer one block table, as if all attended to
            the whole context (vLLM's flag): sliding-window layers then keep blocks they no longer
            read. For comparisons; see executor.kv_groups.
    """

    model: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0
    kv_offloading_size: float = 0.0
    kv_offloading_disk: str | None = None
    kv_offloading_disk_size: float = 0.0
    cpu_kv_cache_space: float = 4.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enforce_eager: bool = False
    step_trace: str | None = None
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT_S
    internal_token_file: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    load_format: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    metrics_port: int | None = None
    tensor_parallel_size: int = 1
    disable_hybrid_kv_cache_manager: bool = False
    # Speculative decoding (its JSON text, a dict or a SpeculativeConfig; None: off): the executor
    # loads the draft_model method's draft; n-gram proposals come in the plans.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # ValueError naming the field
            spec = SpeculativeConfig.parse(self.speculative_config)  # type: ignore[arg-type]
            object.__setattr__(self, "speculative_config", spec)
        problems = []
        if not self.model:
            problems.append("model must name a checkpoint directory")
        if not 0 <= self.port <= 65535:
            problems.append(f"port must be in [0, 65535], got {self.port}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            problems.append(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append(f"max_model_len must be positive, got {self.max_model_len}")
        if self.block_size < 16 or self.block_size % 16:
            problems.append(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            problems.append(f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}")
        if not self.swap_space >= 0:  # also refuses nan
            problems.append(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if not 0 <= self.kv_offloading_size < float("inf"):
            problems.append(f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        problems += self._disk_tier_problems()
        if self.cpu_kv_cache_space <= 0:
            problems.append(f"cpu_kv_cache_space must be > 0 GiB, got {self.cpu_kv_cache_space}")
        if self.max_num_batched_tokens < 1:
            problems.append(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            problems.append(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if not self.lease_timeout > 0:  # also refuses nan
            problems.append(f"lease_timeout must be > 0 seconds, got {self.lease_timeout}")
        try:
            self.server_tls()
        except TlsConfigError as exc:
            problems.append(str(exc))
        if self.load_format not in LOAD_FORMATS:
            problems.append(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization not in QUANTIZATIONS:
            problems.append(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            problems.append(f"metrics_port must be in 1..65535, got {self.metrics_port}")
        if self.tensor_parallel_size < 1:
            problems.append(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            problems.append("speculative_config's draft_model needs tensor_parallel_size 1 (for now)")
        if problems:
            raise ValueError("invalid executor config: " + "; ".join(problems))

    def server_tls(self) -> ServerTls | None:
        """The TLS of the executor's port (None: plaintext)."""
        return ServerTls.from_flags(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)

    def torch_device(self) -> torch.device:
        """The resolved device; asking for CUDA without one is an error, not a silent fallback."""
        if self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
        return torch.device("cuda", torch.cuda.current_device())

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The resolved dtype: "auto" is float32 on the CPU (fast and exact), bfloat16 on CUDA."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * _GIB)

    @property
    def kv_offloading_bytes(self) -> int:
        return int(self.kv_offloading_size * _GIB)

    @property
    def kv_offloading_disk_bytes(self) -> int:
        return int(self.kv_offloading_disk_size * _GIB) if self.kv_offloading_disk else 0

    def _disk_tier_problems(self) -> list[str]:
        """The disk tier's flags go together, below a CPU tier (its fetches land in host blocks)."""
        size, directory = self.kv_offloading_disk_size, self.kv_offloading_disk
        if not 0 <= size < float("inf"):
            return [f"kv_offloading_disk_size must be >= 0 GiB, got {size}"]
        if size > 0 and not directory:
            return ["kv_offloading_disk_size needs kv_offloading_disk, the directory to keep the blocks in"]
        if not directory:
            return []
        if size == 0:
            return ["kv_offloading_disk needs kv_offloading_disk_size > 0 GiB"]
        if self.kv_offloading_size <= 0:
            return ["kv_offloading_disk needs the CPU tier above it: set kv_offloading_size > 0 GiB"]
        if not os.path.isdir(directory):
            return [f"kv_offloading_disk must be an existing directory, got {directory!r}"]
        return []

    @property
    def cpu_kv_cache_bytes(self) -> int:
        return int(self.cpu_kv_cache_space * _GIB)

    @classmethod
    def from_args(
        cls, ns: argparse.Namespace, *, parser: argparse.ArgumentParser | None = None, **overrides: Any
    ) -> ExecutorConfig:
        """Builds a config from parsed `add_cli_args` flags; flags absent from `ns` keep defaults.

        `overrides` win over `ns`, e.g. `from_args(ns, port=0)` when a parent CLI owns --port.
        An invalid value is a bad flag, so it ends the program as argparse would (through
        `parser.error`, else "pagedserve executor: error: ..."; exit 2), naming the flags, not
        with a traceback; constructing ExecutorConfig directly still raises ValueError.
        """
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as exc:
            flags = [name for name in values if name not in overrides]
            exit_bad_flags(str(exc), flags, parser, "pagedserve executor")


def add_cli_args(parser: argparse.ArgumentParser, *, endpoint: bool = True) -> argparse.ArgumentParser:
    """Adds the executor's flags (vLLM names) to `parser`.

    Args:
        parser: the parser (or argument group's parser) to extend.
        endpoint: also add --model, --host, --port and the port's TLS files; a CLI that starts
            several services (`serve`, whose executor listens on loopback) adds its own and
            forwards the rest (`pagedserve.cli.forwarded_flags`).
    """
    group = parser.add_argument_group("executor")
    if endpoint:
        group.add_argument(
            "--model", type=resolve_model, default="",
            help="Hugging Face checkpoint directory (default or empty: the built-in model)",
        )  # fmt: skip
        group.add_argument("--host", default=ExecutorConfig.host, help="gRPC listen address")
        group.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC listen port (0 = any)")
        group.add_argument("--ssl-certfile", default=None, help="serve TLS with this PEM certificate")
        group.add_argument("--ssl-keyfile", default=None, help="the PEM private key of --ssl-certfile")
        group.add_argument(
            "--ssl-ca-certs", default=None, help="require client certificates signed by these PEM CAs (mTLS)"
        )
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights and activations (auto: float32 on the CPU, bfloat16 on CUDA)",
    )
    group.add_argument(
        "--device", choices=DEVICES, default="auto", help="auto: CUDA when a GPU is visible, else the CPU"
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion in tokens (default: the model's)",
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument(
        "--gpu-memory-utilization", type=float, default=0.90,
        help="this executor's share of GPU memory for weights, activations and the KV pool (0..1)",
    )  # fmt: skip
    group.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="a fixed KV pool size in blocks instead of sizing it",
    )
    group.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU swap pool")
    group.add_argument(
        "--kv-offloading-size", type=float, default=0.0,
        help="GiB of host memory for a CPU tier below the prefix cache: blocks the GPU pool evicts "
        "are kept there and loaded back instead of recomputed (default 0: off)",
    )  # fmt: skip
    group.add_argument(
        "--kv-offloading-disk", default=None, metavar="DIR",
        help="a directory for a disk tier below the CPU tier: blocks the CPU tier drops are written "
        "there and read back on a hit (needs --kv-offloading-size and --kv-offloading-disk-size)",
    )  # fmt: skip
    group.add_argument(
        "--kv-offloading-disk-size", type=float, default=0.0,
        help="GiB of --kv-offloading-disk's disk for the disk tier (default 0)",
    )  # fmt: skip
    group.add_argument(
        "--cpu-kv-cache-space", type=float, default=4.0, help="GiB of KV pool when running on the CPU"
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="tokens per step (the chunked-prefill budget)",
    )
    group.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step (the running batch)")
    group.add_argument("--enforce-eager", action="store_true", help="never capture or replay CUDA graphs")
    group.add_argument("--step-trace", default=None, help="write per-step timing (JSON lines) to this file")
    group.add_argument(
        "--lease-timeout",
        type=float,
        default=DEFAULT_LEASE_TIMEOUT_S,
        help="seconds a scheduler's lease lives without a step or a heartbeat; then the executor "
        "frees everything and accepts another scheduler's Attach (default %(default)s)",
    )
    group.add_argument(
        "--internal-token-file", default=None,
        help="file with the token every RPC must carry (default: $PAGEDSERVE_INTERNAL_TOKEN; none: open)",
    )  # fmt: skip
    group.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="auto: read the checkpoint; dummy: random weights of the config's shape, for benchmarks "
        "(pagedserve make-model --no-weights writes such a directory)",
    )
    group.add_argument(
        "--quantization",
        choices=[q for q in QUANTIZATIONS if q],
        default=None,
        help="fp8: e4m3 weights (per-channel scales) and per-token activations; needs Hopper (sm90)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="fp8: store the KV cache in e4m3 with per-layer scales (~2x the blocks); needs sm89+",
    )
    group.add_argument(
        "--metrics-port", type=int, default=None,
        help="serve Prometheus metrics over HTTP on this port (default: not served)",
    )  # fmt: skip
    group.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="devices one executor spans (default 1): N - 1 worker processes join this one in a "
        "torch.distributed group (NCCL on CUDA, rank r on GPU current + r; gloo on the CPU)",
    )  # fmt: skip
    group.add_argument(
        "--disable-hybrid-kv-cache-manager", action="store_true",
        help="one block table for every layer: sliding-window layers keep the blocks their window "
        "left behind (by default they are freed); for comparisons",
    )  # fmt: skip
    group.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, as the scheduler\'s flag (`serve` gives both the same): the '
        'executor loads {"method": "draft_model", "model": DIR, ...}\'s draft; with "ngram" it '
        "proposes as the scheduler does, to launch each verification before its plan; default: off",
    )  # fmt: skip
    return parser
