"""KV-cache arithmetic that the executor (sizing its pool), the scheduler (checking its limits)
and the planning tools share, so they agree on what one sequence needs.

A model's layers form KV-cache groups (executor.kv_groups): a full-attention group keeps a block per
`block_size` positions of a sequence; a sliding-window group only the blocks its queries can still
see. Every group takes blocks from the one pool.
"""

from __future__ import annotations

from collections.abc import Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_per_sequence(
    num_tokens: int,
    block_size: int,
    sliding_windows: Sequence[int | None] = (None,),
    chunk: int | None = None,
) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds at once, over all its groups.

    Args:
        sliding_windows: one entry per KV-cache group: None for full attention, else its window.
        chunk: the most tokens it computes in one step (a prefill chunk); default `num_tokens`.
            A sliding group holds its window plus the step's new positions: while a step computes
            positions [c, c + n), the blocks from the one holding position c - W + 1 to the one
            holding c + n - 1, at most ceil((W - 1 + n) / block_size) + 1 of them.
    """
    chunk = num_tokens if chunk is None else min(chunk, num_tokens)
    full = _cdiv(num_tokens, block_size)
    return sum(
        full if window is None else min(full, _cdiv(window - 1 + chunk, block_size) + 1)
        for window in sliding_windows
    )
