"""The prefix cache's second level: full KV blocks the GPU pool evicted, kept in the executor's host
memory (`--kv-offloading-size`), by (KV-cache group, block hash), least recently used first out.

The tier is an index: which host block holds which cached block. The host blocks themselves are
the executor's CPU pool, whose block ids the KV-cache manager hands out from one free list to both
users, swapped-out requests and this tier, so the two can never over-commit host memory; a swap-out
that finds no free host block takes the tier's least recently used ones (a pre-empted request's KV
matters more than a cached prefix). Moves between the pools travel as the plan's `offload`
(GPU -> host, ahead of eviction) and `load` (host -> GPU, on a hit) block moves, which the executor
runs on a copy stream beside the step's forward (the scheduler plans them so that this step
touches none of their blocks: scheduler.core), or as `swap_out` for a block evicted and reused in
the same step (copied inside it, before its forward).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagedserve.scheduler.block_pool import BlockHash

TierKey = tuple[int, BlockHash]  # (KV-cache group, block hash)


class CpuTier:
    """Which host block holds each cached block, in LRU order; at most `capacity` blocks."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a CPU tier holds at least one block, got {capacity}")
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
        """(key, host block) of every entry, least recently used first; for tests and debugging."""
        return list(self._slots.items())

    def get(self, key: TierKey) -> int | None:
        """The host block holding `key`, without changing the LRU order (a lookup)."""
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

    def evict(self, keep: Iterable[int] = ()) -> int | None:
        """Drops the least recently used entry whose host block is not in `keep` (blocks a move of
        the step being planned reads) and returns its host block; None if every entry is kept."""
        kept = set(keep)
        for key, slot in self._slots.items():
            if slot not in kept:
                del self._slots[key]
                return slot
        return None
