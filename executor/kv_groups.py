"""KV-cache groups: how a model's layers share block tables, and where each layer's KV lives.

Layers that attend alike (full attention, or the same sliding window) can share one block table per
request. A sliding-window layer only ever reads the last `window` positions, so the scheduler can
release its blocks once no query reaches them (scheduler.kv_cache_manager) — but only if those
blocks hold no full-attention layer's KV. So layers are split into groups of one attention kind,
and a block holds one group's layers.

For the pool to stay one free list of interchangeable blocks, every group has the same number of
layers (`layers_per_block`), as in vLLM's hybrid KV-cache manager: the size is the smallest count
of layers of one kind, each kind's layers are cut into groups of that size, and a kind whose count
is not a multiple leaves its last group's remaining slots empty. Gemma 3 12B (8 global, 40 local
layers) has 6 groups of 8: one full, five sliding; a model of one kind has one group of all its
layers, and its blocks are exactly the single-table ones.

The pool is `[layers_per_block, 2, num_blocks, block_size, kv_heads, head_dim]`: layer l's K and V
are slot `layer_slot[l]` of the blocks in its group's table, `layer_group[l]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.protos import executor_pb2


@dataclass(frozen=True)
class KVCacheGroups:
    """The grouping of a model's layers (see the module doc).

    Attributes:
        sliding_windows: per group, None (full attention) or its window.
        layer_group: per layer, its group.
        layer_slot: per layer, its slot within a block (0 .. layers_per_block - 1).
        layers_per_block: layers one block holds (each group's size).
    """

    sliding_windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    layers_per_block: int

    @classmethod
    def for_layers(cls, layer_windows: Sequence[int | None]) -> KVCacheGroups:
        """Groups layers by their sliding window (None: full attention), full attention first,
        then windows from small to large, each kind's layers in model order."""
        if not layer_windows:
            raise ValueError("a model has at least one layer")
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        windows: list[int | None] = []
        group_of, slot_of = [0] * len(layer_windows), [0] * len(layer_windows)
        for window in sorted(kinds, key=lambda w: -1 if w is None else w):
            layers = kinds[window]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    group_of[layer], slot_of[layer] = len(windows), slot
                windows.append(window)
        return cls(tuple(windows), tuple(group_of), tuple(slot_of), size)

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_windows[self.layer_group[layer]]

    def to_proto(self) -> list[executor_pb2.KVCacheGroup]:
        """What the executor reports on attach: each group's window (0 = full) and layer count."""
        counts = [0] * self.num_groups
        for group in self.layer_group:
            counts[group] += 1
        return [
            executor_pb2.KVCacheGroup(sliding_window=window or 0, num_layers=count)
            for window, count in zip(self.sliding_windows, counts, strict=True)
        ]
