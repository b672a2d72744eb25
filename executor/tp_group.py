"""Tensor parallelism, the process group: one torch.distributed group of N ranks, one per device.

Two groups over the same ranks:
* the *device* group (NCCL on CUDA, gloo on the CPU) carries what the forward pass needs: the
  all-reduce after o_proj and after down_proj (`all_reduce`, captured into the CUDA graphs like any
  kernel), the sampled tokens rank 0 hands the others (`broadcast_tokens`), and the start-up
  all-reduce MIN that sizes the KV pools (`min_over_ranks`);
* the *control* group (gloo, on the CPU) carries the step messages from rank 0 (`send` / `recv`):
  each StepPlan as its serialized bytes, a reset when a lease ends, a stop. Workers wait on it
  between steps, possibly for hours while the executor idles, so its timeout is a year (a dead rank
  0 is noticed by the workers' parent watch, not by a timeout).

Rank r of an executor on CUDA uses GPU `base + r`, where `base` is rank 0's device index (its
`torch.cuda.current_device()`, 0 unless the process chose another): `serve --data-parallel-size D
--tensor-parallel-size N` makes executor i see GPUs i*N..i*N+N-1 (CUDA_VISIBLE_DEVICES), so its
ranks use local devices 0..N-1. NCCL's NVLink multicast (NVLS) stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Control message kinds (the first int64 of each message's header).
STEP, RESET, STOP = 1, 2, 3
_IDLE_TIMEOUT = datetime.timedelta(days=365)
_STARTUP_TIMEOUT = datetime.timedelta(minutes=15)  # ranks joining: model loading and profiling included


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's TCPStore."""

    host: str
    port: int


def rank_device(device_type: str, base_index: int, rank: int) -> torch.device:
    """Rank r's device: the CPU, or GPU base_index + r."""
    if device_type == "cuda":
        return torch.device("cuda", base_index + rank)
    return torch.device("cpu")


class TensorParallelGroup:
    """This process's membership of the group; `rank == 0` is the executor that speaks gRPC."""

    def __init__(self, rank: int, size: int, device: torch.device, store: dist.Store) -> None:
        self.rank, self.size, self.device = rank, size, device
        if device.type == "cuda":
            os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off (module docstring)
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=size,
            timeout=_STARTUP_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
        self.control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        self._header = torch.zeros(2, dtype=torch.int64)

    @staticmethod
    def host_store(size: int) -> dist.TCPStore:
        """Rank 0's store on a free loopback port (`.port`), for the workers to join."""
        return dist.TCPStore(
            "127.0.0.1", 0, world_size=size, is_master=True, wait_for_workers=False, timeout=_STARTUP_TIMEOUT
        )

    @classmethod
    def join(cls, rank: int, size: int, device: torch.device, rendezvous: Rendezvous) -> TensorParallelGroup:
        """A worker's membership, through rank 0's store."""
        store = dist.TCPStore(
            rendezvous.host, rendezvous.port, world_size=size, is_master=False, timeout=_STARTUP_TIMEOUT
        )
        return cls(rank, size, device, store)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sums `t` over the ranks, in place (the row-parallel projections' partial sums)."""
        dist.all_reduce(t)

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` of all ranks (every rank calls it, in the same order)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_tokens(self, tokens: torch.Tensor) -> None:
        """Rank 0's sampled tokens into every other rank's `tokens` (same shape, int64)."""
        dist.broadcast(tokens, src=0)

    def send(self, kind: int, payload: bytes = b"") -> None:
        """Rank 0: one control message to every worker."""
        header = torch.tensor([kind, len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.control)

    def recv(self) -> tuple[int, bytes]:
        """A worker: the next control message from rank 0 (blocks while the executor idles)."""
        dist.broadcast(self._header, src=0, group=self.control)
        kind, length = (int(v) for v in self._header.tolist())
        if not length:
            return kind, b""
        data = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        return kind, data.numpy().tobytes()

    def close(self) -> None:
        """Leaves the group at shutdown. On CUDA the NCCL communicator is left to process exit:
        `destroy_process_group` can hang in ncclCommDestroy once NCCL collectives were captured
        into CUDA graphs (pytorch/pytorch#115388), and a stop must never hang."""
        if dist.is_initialized() and self.device.type != "cuda":
            dist.destroy_process_group()
