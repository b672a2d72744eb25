"""N-gram (prompt lookup) proposals for speculative decoding, as vLLM's NgramProposer makes them.

The scheduler holds every request's tokens, so it proposes: take the request's last n tokens, for n
from prompt_lookup_max down to prompt_lookup_min; at the first n whose n-gram occurred earlier in
prompt + output, propose the (up to) k tokens that followed its first occurrence. Outputs that copy
their prompt (edits, extraction, code rewrites) are then mostly proposed right.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to `k` proposed next tokens for the sequence `tokens` (empty: no n-gram matched).

    Args:
        tokens: the request's known tokens, prompt then outputs.
        k: the most tokens to propose.
        lookup_min / lookup_max: the shortest and longest suffix n-gram to look up.
    """
    ids = np.asarray(tokens, dtype=np.int64)
    length = len(ids)
    if k < 1:
        return []
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = ids[length - n :]
        # Windows starting at 0 .. length - n - 1: every occurrence before the suffix itself.
        windows = sliding_window_view(ids[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return ids[start : start + k].tolist()
    return []
