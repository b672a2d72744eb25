"""The prefix cache's disk tier (`--kv-offloading-disk DIR`, `--kv-offloading-disk-size GiB`): KV
blocks the CPU tier dropped, in one file of the executor's, one block-sized slot each.

The scheduler decides everything (scheduler.kv_tier): which host block to write to which slot
(`StepPlan.spill`) and which slot to read back into which host block (`StepPlan.fetch`), before the
next plan loads that host block to the GPU. This module only moves the bytes, between the pinned
host pool (executor.kv_cache) and the file, with positional reads and writes: the file never moves
a file pointer, so the I/O threads' reads and writes need no lock.

The file is created in DIR with a name of its own and unlinked at once: its space stays reserved
while the executor holds it open, and nothing is left behind however the executor ends (a SIGKILL
included). Its blocks are reserved up front (`posix_fallocate`) so that a disk too small fails at
start with a clear error, not at the first spill.
"""

from __future__ import annotations

import errno
import os
import shutil
import weakref
from pathlib import Path

import torch

__all__ = ["DiskTierError", "DiskTierFile"]

_GIB = 1 << 30


class DiskTierError(RuntimeError):
    """The disk tier cannot be created where --kv-offloading-disk says."""


class DiskTierFile:
    """`num_blocks` slots of `bytes_per_block` bytes in an unlinked file in `directory`."""

    def __init__(self, directory: str | Path, num_blocks: int, bytes_per_block: int) -> None:
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        size = num_blocks * bytes_per_block
        directory = Path(directory)  # (an existing directory: ExecutorConfig checked)
        free = shutil.disk_usage(directory).free
        if size > free:
            raise DiskTierError(
                f"the disk tier ({size / _GIB:.2f} GiB, --kv-offloading-disk-size) does not fit in "
                f"{directory} ({free / _GIB:.2f} GiB free): lower --kv-offloading-disk-size"
            )
        path = directory / f".pagedserve-kv-{os.getpid()}-{id(self):x}"
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise DiskTierError(f"--kv-offloading-disk {directory}: cannot create a file ({exc})") from None
        os.unlink(path)  # (the open descriptor keeps the space)
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:  # no space after all, or a file system that cannot reserve
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # (those: reserve by size only)
                os.close(self._fd)
                raise DiskTierError(
                    f"cannot reserve {size / _GIB:.2f} GiB in {directory} for the disk tier: {exc}"
                ) from None
            os.ftruncate(self._fd, size)
        # Closed (its space given back) with `close` or when the executor's KV cache goes away, as
        # an in-process `LLM` does on shutdown.
        self._closer = weakref.finalize(self, os.close, self._fd)

    def write(self, slot: int, block: torch.Tensor) -> None:
        """Writes one host block (a contiguous CPU tensor of `bytes_per_block` bytes) to `slot`."""
        data = _bytes_of(block, self.bytes_per_block)
        offset = self._offset(slot)
        written = 0
        while written < len(data):
            written += os.pwrite(self._fd, data[written:], offset + written)

    def read_into(self, slot: int, block: torch.Tensor) -> None:
        """Reads `slot` into one host block (a contiguous CPU tensor of `bytes_per_block` bytes)."""
        data = _bytes_of(block, self.bytes_per_block)
        offset = self._offset(slot)
        done = 0
        while done < len(data):
            count = os.preadv(self._fd, [data[done:]], offset + done)
            if count == 0:
                raise DiskTierError(f"disk tier slot {slot}: the file ended early")
            done += count

    def close(self) -> None:
        self._closer()

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"disk tier slot {slot} outside [0, {self.num_blocks})")
        return slot * self.bytes_per_block


def _bytes_of(block: torch.Tensor, size: int) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    if block.device.type != "cpu" or not block.is_contiguous():
        raise ValueError("a disk tier move needs a contiguous host block")
    data = memoryview(block.view(torch.uint8).reshape(-1).numpy()).cast("B")
    if len(data) != size:
        raise ValueError(f"a host block of {len(data)} bytes, the disk tier's are {size}")
    return data
