"""The KV pool: paged K/V blocks on the device, a swap pool of the same blocks in CPU memory.

The device pool is one tensor, [layers_per_block, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]; `layer_caches()` hands the kernels each layer's contiguous K and V views. A block holds
one KV-cache group's layers (executor.kv_groups): all the model's layers when it has one group, and
layer l is slot `layer_slot[l]` of the blocks of its group's table. The CPU pool is
block-major, [num_blocks, layers_per_block, 2, block_size, num_kv_heads, head_dim], and pinned on CUDA, so
each CPU block is one contiguous span: a swap is one gather or scatter on the device plus one
asynchronous copy per run of consecutive CPU blocks, and never makes the host wait for the GPU.

The CPU tier's copies (`StepPlan.offload` / `load`) run on a copy stream of their own
(`copy_beside`), so that a load or an offload costs the steps bandwidth, not time: the copy stream
first waits for everything queued on the compute stream so far (the steps that last wrote or read
those blocks), and the compute stream waits for the copies (`wait_for_copies`) before the next
step's forward, the first that may touch their blocks (the scheduler guarantees that the step they
are planned in does not). The copies stay in plan order on one stream, so a host block that a later
plan reuses is written only after the earlier copies that read it. On the CPU everything is
synchronous and `copy_beside` is plain swap_out then swap_in.

The disk tier (executor.disk_tier, `StepPlan.spill` / `fetch` / `spill_ahead`) moves host blocks to
and from a file, before the plan's other moves (`spill_and_fetch`), once the copies already queued
that touch those host blocks are done, on a pool of I/O threads (one thread reads a file from the
page cache at a few GB/s; several go faster): the launching thread waits for the spills (the plan
may reuse their host blocks); the fetches and spills ahead run while the step runs, and the next
plan waits for them before its moves.

An FP8 pool (`--kv-cache-dtype fp8`) has one-byte elements, so `bytes_per_block` halves and the
same memory holds about twice the blocks (the swap pool too). Both pools are then allocated as
uint8 and the kernels get float8_e4m3fn views: the gathers, scatters and copies of swapping move
bytes and need no float8 support from torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from pagedserve.common.kv_sizing import blocks_per_sequence
from pagedserve.executor.transfer import to_device

if TYPE_CHECKING:
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.disk_tier import DiskTierFile

log = structlog.get_logger(__name__)

# Threads that move disk tier blocks (each block one positional read or write, which releases the
# GIL): enough to keep an NVMe drive's queue or the page cache's copies busy.
DISK_IO_THREADS = 8


class KVCacheTooSmallError(RuntimeError):
    """The pool cannot hold one sequence of max_model_len; the message says what would fit."""


class HostPoolError(RuntimeError):
    """The host pool (--swap-space + --kv-offloading-size) is more than this machine can hold."""


def host_memory_available() -> int | None:
    """Bytes the kernel says it can give without swapping (MemAvailable); None where unknown."""
    try:
        for line in open("/proc/meminfo"):  # noqa: SIM115 - read to the line
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape and dtype of one block, shared by the device and CPU pools.

    `layers_per_block`: the layers whose KV one block holds: the model's layers for a model of one
    KV-cache group, each group's size otherwise (executor.kv_groups)."""

    layers_per_block: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across its layers, K and V."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers_per_block * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def storage_dtype(self) -> torch.dtype:
        """What the pools are allocated as: uint8 for float8 layouts (see the module doc)."""
        return torch.uint8 if self.dtype.is_floating_point and self.dtype.itemsize == 1 else self.dtype

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The device pool's shape: per layer slot, K and V of all blocks."""
        return (self.layers_per_block, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def cpu_pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The CPU pool's shape: block-major, each block's layers, K and V in one span."""
        return (num_blocks, self.layers_per_block, 2, self.block_size, self.num_kv_heads, self.head_dim)


def cpu_device_num_blocks(
    layout: KVCacheLayout,
    space_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    sliding_windows: Sequence[int | None] = (None,),
) -> int:
    """Pool size when the model runs on the CPU: `space_bytes` worth of blocks, but never more than
    max_num_seqs full-length sequences could use (more would only cost RAM)."""
    cap = max_num_seqs * blocks_per_sequence(max_model_len, layout.block_size, sliding_windows)
    return min(space_bytes // layout.bytes_per_block, cap)


def gpu_num_blocks(
    layout: KVCacheLayout,
    total_bytes: int,
    utilization: float,
    peak_bytes: int,
    non_torch_bytes: int,
    in_use_at_start: int = 0,
) -> int:
    """Pool size on CUDA: what is left of this executor's share after the profiled peak usage.

    The share is utilization * total, or what was free when the executor started if that is less
    (a share of 1.0 beside a CUDA context, or shares of executors on one GPU adding up to more).

    Args:
        total_bytes: the device's total memory.
        peak_bytes: torch's peak allocation during the profiling pass (weights + activations).
        non_torch_bytes: memory this executor took outside torch's allocator (libraries, kernels).
        in_use_at_start: device memory in use before the executor loaded anything (other
            processes, its CUDA context): not part of its share.
    """
    share = min(int(total_bytes * utilization), total_bytes - in_use_at_start)
    available = share - peak_bytes - non_torch_bytes
    return max(available, 0) // layout.bytes_per_block


@dataclass(frozen=True)
class MemoryProfile:
    """What everything but the KV pool needs on CUDA: measured by `executor.profiling.profile_cuda`,
    or estimated by `executor.memory_estimate` (`pagedserve plan`); both feed `size_pools`."""

    peak_bytes: int  # torch's peak over the worst eager step, weights included, scratch pool excluded
    non_torch_bytes: int  # taken outside torch's allocator since the start (libraries, kernels)
    total_bytes: int  # the device's memory
    graph_reserve_bytes: int  # set aside for CUDA graphs (0 without them)


@dataclass(frozen=True)
class PoolSizing:
    """How many blocks each pool gets, and the arithmetic in words (the executor logs it, and
    `pagedserve plan` prints it)."""

    num_gpu_blocks: int
    num_cpu_blocks: int  # the host pool: the swap pool and the CPU tier together
    why: str
    num_cpu_offload_blocks: int = 0  # the CPU tier's share of the host pool
    num_disk_offload_blocks: int = 0  # the disk tier's slots (--kv-offloading-disk-size)


def size_pools(
    layout: KVCacheLayout,
    config: ExecutorConfig,
    max_model_len: int,
    device_type: str,
    sliding_windows: Sequence[int | None] = (None,),
    memory: MemoryProfile | None = None,
    in_use_at_start: int = 0,
) -> PoolSizing:
    """The one decision of both pools' sizes, shared by the executor (`ModelRunner.from_model`, with
    a measured `memory`) and `pagedserve plan` (with an estimated one), so that the two differ only
    by the profile: --num-gpu-blocks-override if given, else on CUDA what `gpu_num_blocks` leaves
    after `memory`, else the CPU's `cpu_device_num_blocks`; the host pool is --swap-space's worth plus
    --kv-offloading-size's (the CPU tier's share), one pool so that the two cannot over-commit it.

    Raises:
        ValueError: on CUDA without an override and without `memory`.
    """
    if config.num_gpu_blocks_override is not None:
        num_blocks, why = config.num_gpu_blocks_override, "--num-gpu-blocks-override"
    elif device_type == "cuda":
        if memory is None:
            raise ValueError("sizing a CUDA pool needs a memory profile (measured or estimated)")
        graph_reserve = memory.graph_reserve_bytes
        num_blocks = gpu_num_blocks(
            layout, memory.total_bytes, config.gpu_memory_utilization,
            memory.peak_bytes + graph_reserve, memory.non_torch_bytes, in_use_at_start,
        )  # fmt: skip
        why = (
            f"{config.gpu_memory_utilization:.2f} of {memory.total_bytes / 2**30:.1f} GiB minus a peak of "
            f"{memory.peak_bytes / 2**30:.2f} GiB, {memory.non_torch_bytes / 2**30:.2f} GiB outside torch "
            f"and {graph_reserve / 2**30:.2f} GiB for CUDA graphs; {in_use_at_start / 2**30:.2f} GiB "
            "were in use on the device before the executor loaded anything"
        )
    else:
        num_blocks = cpu_device_num_blocks(
            layout, config.cpu_kv_cache_bytes, config.max_num_seqs, max_model_len, sliding_windows
        )
        why = f"--cpu-kv-cache-space {config.cpu_kv_cache_space} GiB"
    per_block = layout.bytes_per_block
    num_offload = config.kv_offloading_bytes // per_block
    num_disk = config.kv_offloading_disk_bytes // per_block if num_offload else 0
    return PoolSizing(
        num_blocks, config.swap_space_bytes // per_block + num_offload, why, num_offload, num_disk
    )


def check_fits(
    layout: KVCacheLayout,
    num_blocks: int,
    max_model_len: int,
    *,
    why: str,
    sliding_windows: Sequence[int | None] = (None,),
    max_num_batched_tokens: int | None = None,
) -> None:
    """Fails at startup when one max_model_len sequence cannot fit (the scheduler checks the same,
    with the same arithmetic: common.kv_sizing), naming the largest that can."""

    def needed(num_tokens: int) -> int:
        return blocks_per_sequence(num_tokens, layout.block_size, sliding_windows, max_num_batched_tokens)

    if num_blocks < needed(max_model_len):
        fits = max(
            (n for n in range(0, max_model_len, layout.block_size) if needed(n) <= num_blocks), default=0
        )
        raise KVCacheTooSmallError(
            f"the KV pool has {num_blocks} blocks of {layout.block_size} tokens ({why}), which cannot "
            f"hold one sequence of max_model_len={max_model_len}; the largest length that fits is "
            f"{fits}: lower --max-model-len or give the pool more memory"
        )


class KVCache:
    """Owns the device KV pool and the CPU swap pool, and copies blocks between them."""

    def __init__(
        self, layout: KVCacheLayout, num_device_blocks: int, num_cpu_blocks: int, device: torch.device
    ) -> None:
        self.layout = layout
        self.device = device
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        # Zeroed so kernels that read a partly filled block's tail (masked later) never see NaNs.
        self.device_pool = torch.zeros(
            layout.pool_shape(num_device_blocks), dtype=layout.storage_dtype, device=device
        )
        # Pinned on CUDA so block copies are asynchronous and run at full PCIe bandwidth; only
        # swapped-out and offloaded blocks are ever read back, so no need to initialise it.
        host_bytes = num_cpu_blocks * layout.bytes_per_block
        available = host_memory_available()
        if available is not None and host_bytes > available:
            raise HostPoolError(
                f"the host pool (--swap-space + --kv-offloading-size: {num_cpu_blocks} blocks, "
                f"{host_bytes / 2**30:.1f} GiB) is more than the {available / 2**30:.1f} GiB of memory "
                "this machine has available: lower --swap-space or --kv-offloading-size"
            )
        try:
            self.cpu_pool = torch.empty(
                layout.cpu_pool_shape(num_cpu_blocks),
                dtype=layout.storage_dtype,
                pin_memory=device.type == "cuda",
            )
        except RuntimeError as exc:  # pinning beyond what the driver or ulimit -l allows
            raise HostPoolError(
                f"cannot pin a host pool of {host_bytes / 2**30:.1f} GiB (--swap-space + "
                f"--kv-offloading-size): {exc}"
            ) from None
        # The CPU tier's copy stream (CUDA only), and the event behind the last copies queued on it.
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copies_done: torch.cuda.Event | None = None
        # The disk tier below the CPU tier (None: off; the runner opens it), and the copies queued
        # to or from host blocks that may still run (their host blocks, and the event behind them):
        # the CPU waits for those that touch a host block it reads or writes (`spill_and_fetch`).
        self.disk: DiskTierFile | None = None
        self._host_copies: list[tuple[frozenset[int], torch.cuda.Event]] = []
        self._disk_io: ThreadPoolExecutor | None = None  # started by the first disk move
        self._background: list[Future[None]] = []  # the last plan's fetches and spills ahead

    def layer_caches(
        self, layer_slot: Sequence[int] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V), each a contiguous [num_blocks, block_size, num_kv_heads, head_dim] view of
        the layer's slot (`KVCacheGroups.layer_slot`; default: layer i is slot i, one group)."""
        pool = self.device_pool.view(self.layout.dtype)
        slots = range(self.layout.layers_per_block) if layer_slot is None else layer_slot
        return [(pool[i, 0], pool[i, 1]) for i in slots]

    def swap_out(self, src_device_blocks: list[int], dst_cpu_blocks: list[int]) -> None:
        """Copies device blocks to CPU blocks, all layers at once, queued behind the steps already
        launched (which may still be writing them)."""
        if not src_device_blocks:
            return
        src = to_device(src_device_blocks, torch.int64, self.device)
        blocks = self.device_pool.movedim(2, 0)[src]  # gathered block-major, as the CPU pool holds them
        for start, cpu_block, length in _runs(dst_cpu_blocks):
            self.cpu_pool[cpu_block : cpu_block + length].copy_(
                blocks[start : start + length], non_blocking=True
            )
        self._note_host_copies(dst_cpu_blocks)

    def swap_in(self, src_cpu_blocks: list[int], dst_device_blocks: list[int]) -> None:
        """Copies CPU blocks to device blocks, all layers at once, queued like any step's work."""
        if not src_cpu_blocks:
            return
        shape = self.layout.cpu_pool_shape(len(src_cpu_blocks))
        # block-major, as copied
        blocks = torch.empty(shape, dtype=self.layout.storage_dtype, device=self.device)
        for start, cpu_block, length in _runs(src_cpu_blocks):
            blocks[start : start + length].copy_(
                self.cpu_pool[cpu_block : cpu_block + length], non_blocking=True
            )
        self._note_host_copies(src_cpu_blocks)
        dst = to_device(dst_device_blocks, torch.int64, self.device)
        self.device_pool.index_copy_(2, dst, blocks.movedim(0, 2))

    def copy_beside(self, offload: list[tuple[int, int]], load: list[tuple[int, int]]) -> None:
        """The CPU tier's copies of one plan: (device -> host) offloads, then (host -> device) loads,
        on the copy stream behind all the work queued on the compute stream so far (its steps may
        still write or read those blocks); synchronous on the CPU."""
        if not offload and not load:
            return
        if self._copy_stream is None:
            self._copy(offload, load)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):  # (temporaries live and die on this stream)
            self._copy(offload, load)
        self._copies_done = self._copy_stream.record_event()

    def _copy(self, offload: list[tuple[int, int]], load: list[tuple[int, int]]) -> None:
        self.swap_out([src for src, _ in offload], [dst for _, dst in offload])
        self.swap_in([src for src, _ in load], [dst for _, dst in load])

    @property
    def num_disk_blocks(self) -> int:
        """The disk tier's slots (0: no disk tier)."""
        return 0 if self.disk is None else self.disk.num_blocks

    def spill_and_fetch(
        self,
        spill: list[tuple[int, int]],
        fetch: list[tuple[int, int]],
        spill_ahead: list[tuple[int, int]],
    ) -> None:
        """The disk tier's moves of one plan, before its others: first the last plan's fetches and
        spills ahead are waited for (this plan loads the fetched blocks; they had a step to run),
        then spills (host block -> disk slot) are written, the caller waiting, and fetches (disk
        slot -> host block) and spills ahead (host block -> disk slot, of blocks no move of this
        plan touches) start beside the step. The CPU reads and writes the host blocks, so the
        copies queued before that touch host blocks (swaps on the compute stream, the CPU tier's
        copies on the copy stream) must have finished: only those that touch these host blocks are
        waited for (the CPU tier's oldest blocks, copied long ago: usually none). The scheduler
        keeps a fetch's host block out of every other move of its plan and the next, a spill
        ahead's out of its plan's."""
        self.wait_for_disk_io()
        if not spill and not fetch and not spill_ahead:
            return
        disk = self.disk
        if disk is None:
            raise RuntimeError("a plan moves disk tier blocks, but this executor has no disk tier")
        hosts = {host for host, _ in spill}.union((h for _, h in fetch), (h for h, _ in spill_ahead))
        for blocks, event in self._host_copies:
            if not blocks.isdisjoint(hosts):
                event.synchronize()
        if self._disk_io is None:
            self._disk_io = ThreadPoolExecutor(DISK_IO_THREADS, thread_name_prefix="kv-disk-io")
        pool = self._disk_io
        writes = [pool.submit(disk.write, slot, self.cpu_pool[host]) for host, slot in spill]
        for write in writes:
            write.result()
        self._background = [pool.submit(disk.read_into, slot, self.cpu_pool[host]) for slot, host in fetch]
        self._background += [pool.submit(disk.write, slot, self.cpu_pool[host]) for host, slot in spill_ahead]

    def wait_for_disk_io(self) -> None:
        """Waits for the disk I/O `spill_and_fetch` started beside the step (re-raising the first
        error)."""
        background, self._background = self._background, []
        for move in background:
            move.result()

    def _note_host_copies(self, host_blocks: list[int]) -> None:
        """Records, on the stream that just queued copies to or from `host_blocks`, the event that
        `spill_and_fetch` waits for if it touches one of them (only with a disk tier, on CUDA);
        forgets the copies that are done."""
        if self.disk is not None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            self._host_copies = [(b, e) for b, e in self._host_copies if not e.query()]
            self._host_copies.append((frozenset(host_blocks), stream.record_event()))

    def wait_for_copies(self) -> None:
        """Makes the compute stream wait for the copies queued by `copy_beside` (before a step that
        may read a loaded block, write an offloaded one, or reuse a host block they read)."""
        if self._copies_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copies_done)
            self._copies_done = None


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Splits block ids into runs of consecutive ids: (index of the run's first id, that id, length).
    The scheduler hands CPU blocks out in order, so a sequence's blocks are mostly one run."""
    runs: list[tuple[int, int, int]] = []
    for index, block_id in enumerate(block_ids):
        if runs and block_id == runs[-1][1] + runs[-1][2]:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((index, block_id, 1))
    return runs
