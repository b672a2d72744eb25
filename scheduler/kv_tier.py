"""The prefix cache's lower levels: full KV blocks the GPU pool evicted, kept in the executor's host
memory (`--kv-offloading-size`, the CPU tier) and below it on its disk (`--kv-offloading-disk`),
by (KV-cache group, block hash), least recently used first out.

Each tier is an index: which slot holds which cached block. The CPU tier's slots are the executor's
host pool, whose block ids the KV-cache manager hands out from one free list to both users,
swapped-out requests and this tier, so the two can never over-commit host memory; a swap-out
that finds no free host block takes the tier's least recently used ones (a pre-empted request's KV
matters more than a cached prefix). Moves between the pools travel as the plan's `offload`
(GPU -> host, ahead of eviction) and `load` (host -> GPU, on a hit) block moves, which the executor
runs on a copy stream beside the step's forward (the scheduler plans them so that this step
touches none of their blocks: scheduler.core), or as `swap_out` for a block evicted and reused in
the same step (copied inside it, before its forward).

The disk tier's slots are block-sized places in one file of the executor's. A block the CPU tier
drops is first written there (the plan's `spill`: host -> disk), and a prefix found only on disk is
read back into a host block of the CPU tier (`fetch`: disk -> host) while the plan's step runs,
then loaded from there by the next plan like any CPU-tier hit. The executor writes a plan's spills
before any of its other moves, and its fetches and spills ahead (the CPU tier's oldest blocks,
written before the next plan needs their host blocks) beside its step, waiting for them before the
next plan's moves (scheduler.kv_cache_manager plans them so that no other move touches them).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from pagedserve.scheduler.block_pool import BlockHash

TierKey = tuple[int, BlockHash]  # (KV-cache group, block hash)


def load_budget(
    weight_read_bytes: int, device_bytes_per_s: float, host_bytes_per_s: float, bytes_per_block: int
) -> int:
    """The most blocks one plan loads from the tier (`SchedulerConfig.max_num_loaded_blocks`): as
    many as the host link moves while the device reads the weights once, the least time any forward
    takes; 0 (no limit) where a bandwidth is unknown (off CUDA, whose executor copies inside the step).

    The executor runs a plan's loads beside its forward, and the next forward waits for them. When
    many requests are admitted at once on tier hits (the pool frees the blocks of a batch that
    finished together), their loads in one plan outlast its forward many times over: W6 on the
    H200 admitted ~19 turns of ~100 blocks in one plan, ~85 ms of copies beside a 7 ms decode, so
    every running request stalled for them, and the turns' prefill chunks then ran together in one
    step of ~5,000 tokens. Within the budget each plan's loads hide behind its forward, the requests
    start one plan after another, and each one's chunk overlaps the next one's loads.
    """
    if weight_read_bytes <= 0 or device_bytes_per_s <= 0 or host_bytes_per_s <= 0 or bytes_per_block <= 0:
        return 0
    seconds = weight_read_bytes / device_bytes_per_s
    return max(1, int(seconds * host_bytes_per_s // bytes_per_block))


def _load_budget_override() -> int | None:
    """`PAGEDSERVE_MAX_NUM_LOADED_BLOCKS`: the tier's loads per plan instead of `load_budget`'s (0:
    no limit), to measure what the budget does; None where unset."""
    value = os.environ.get("PAGEDSERVE_MAX_NUM_LOADED_BLOCKS", "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"PAGEDSERVE_MAX_NUM_LOADED_BLOCKS must be a non-negative integer, got {value!r}")
    return int(value)


LOAD_BUDGET_OVERRIDE = _load_budget_override()


class TierIndex:
    """Which slot (a host block, or a place in the disk tier's file) holds each cached block, in LRU
    order; at most `capacity` blocks."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a tier holds at least one block, got {capacity}")
        self.capacity = capacity
        self._slots: OrderedDict[TierKey, int] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: TierKey) -> bool:
        return key in self._slots

    @property
    def is_full(self) -> bool:
        return len(self._slots) >= self.capacity

    def items(self) -> list[tuple[TierKey, int]]:
        """(key, slot) of every entry, least recently used first; for tests and debugging."""
        return list(self._slots.items())

    def oldest(self) -> Iterator[tuple[TierKey, int]]:
        """(key, slot) of the entries, least recently used first (do not change the index while
        iterating)."""
        return iter(self._slots.items())

    def get(self, key: TierKey) -> int | None:
        """The slot holding `key`, without changing the LRU order (a lookup)."""
        return self._slots.get(key)

    def touch(self, key: TierKey) -> None:
        """Marks `key` used now (a hit that loads it)."""
        self._slots.move_to_end(key)

    def insert(self, key: TierKey, slot: int) -> None:
        if key in self._slots or self.is_full:
            raise ValueError(
                f"cannot insert {key[1][:4].hex()} (held: {key in self._slots}, full: {self.is_full})"
            )
        self._slots[key] = slot

    def evict(self, keep: Iterable[int] = ()) -> tuple[TierKey, int] | None:
        """Drops the least recently used entry whose slot is not in `keep` (slots a move of the step
        being planned reads or writes) and returns it; None if every entry is kept."""
        kept = set(keep)
        for key, slot in self._slots.items():
            if slot not in kept:
                del self._slots[key]
                return key, slot
        return None
