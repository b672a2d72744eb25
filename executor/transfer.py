"""Host <-> device copies that never make the host wait for the GPU.

The executor launches step N+1 while step N still runs, so nothing on the hot path may synchronise
with the device. Two habits keep it so:

* host -> device: data is written into *pinned* host memory and copied with `non_blocking=True`.
  (`torch.tensor(list, device="cuda")` and copies from pageable memory wait for the stream.) Pinned
  buffers come from torch's caching host allocator, which records an event at each non-blocking
  copy and hands a freed buffer out again only after that copy has run, so a buffer can be dropped
  as soon as its copy is queued.
* device -> host: results are copied into pinned memory with `non_blocking=True` behind a CUDA
  event; the host reads them only after the event has completed (`.tolist()` or `.cpu()` would wait
  at once).

On the CPU every helper degrades to plain tensors and synchronous work, so one code path serves both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def pinned(device: torch.device) -> bool:
    """Whether host staging buffers for `device` should be pinned (only CUDA can use them)."""
    return device.type == "cuda"


def aligned_length(n: int) -> int:
    """n rounded up to even: int64 fields of that length keep the next one 16-byte aligned, which
    Triton specialises kernels on (unaligned views would compile a second variant mid-serving)."""
    return n + (n & 1)


def pack_int64(
    arrays: Sequence[np.ndarray], device: torch.device, field_len: int | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Packs int arrays into one (pinned on CUDA) int64 host buffer, so one copy moves them all.

    Args:
        arrays: 1-d integer arrays.
        field_len: place array i at offset i * field_len (each must fit); None = back to back, each
            starting at an even offset.

    Returns:
        (host buffer, offset of each array in it).
    """
    lengths = [len(a) for a in arrays]
    if field_len is None:
        spans = [aligned_length(n) for n in lengths]
        offsets = np.concatenate(([0], np.cumsum(spans[:-1], dtype=np.int64))).tolist() if arrays else []
        total = sum(spans)
    else:
        assert max(lengths, default=0) <= field_len, "an array exceeds its field"
        offsets = [i * field_len for i in range(len(arrays))]
        total = field_len * len(arrays)
    host = torch.empty(total, dtype=torch.int64, pin_memory=pinned(device))
    view = host.numpy()
    for a, offset in zip(arrays, offsets, strict=True):
        view[offset : offset + len(a)] = a
    return host, offsets


def int64_to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Copies int arrays to `device` in one non-blocking transfer; returns int64 device views."""
    host, offsets = pack_int64(arrays, device)
    packed = host.to(device, non_blocking=True)
    return [packed[o : o + len(a)] for a, o in zip(arrays, offsets, strict=True)]


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small list as a device tensor, without waiting for the device (unlike torch.tensor(...,
    device=cuda), which copies from pageable memory and synchronises)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=pinned(device))
    return host.to(device, non_blocking=True)


def bytes_to_device(
    data: bytes, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A packed buffer (a plan's bytes field) as a device tensor of `shape`, in one non-blocking
    copy through pinned memory."""
    src = (
        torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
        if data
        else torch.empty(shape, dtype=dtype)
    )
    if device.type == "cpu":
        return src
    host = torch.empty(shape, dtype=dtype, pin_memory=True)
    host.copy_(src)
    return host.to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Starts copying `t` to (pinned) host memory; read it only after a later event has completed."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
