"""N-gram (prompt lookup) proposals for speculative decoding, as vLLM's NgramProposer makes them.

Take the request's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min; at the
first n whose n-gram occurred earlier in prompt + output, propose the (up to) k tokens that followed
its first occurrence. Outputs that copy their prompt (edits, extraction, code rewrites) are then
mostly proposed right.

Shared by both services: the scheduler proposes from every request's tokens for each plan
(`scheduler.ngram.NgramProposer`), and the executor proposes the same tokens from its own copy of a
request's tokens to launch the next verification before its plan comes
(`ModelRunner.launch_ahead`): the plan, made by this same function, then names that step.

It runs for every speculating request at every step, on a CPU, so it is kept cheap: the search
compares the whole history with one token only (the last), then checks the few positions that
match it against the rest of the n-gram: ~16 us for 1,200 tokens, against ~120 us for comparing
every window of the history.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["propose_ngram"]


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to `k` proposed next tokens for the sequence `tokens` (empty: no n-gram matched).

    Args:
        tokens: the request's known tokens, prompt then outputs.
        k: the most tokens to propose.
        lookup_min / lookup_max: the shortest and longest suffix n-gram to look up.
    """
    ids = np.asarray(tokens, dtype=np.int64)
    length = len(ids)
    if k < 1 or length < 2:
        return []
    # Where an earlier n-gram could end: a position before the last whose token is the last token
    # (a token must follow it, so the last position itself is not one).
    ends = np.flatnonzero(ids[:-1] == ids[-1])
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        matches = ends[ends >= n - 1]
        for back in range(1, n):
            if not len(matches):
                break
            matches = matches[ids[matches - back] == ids[length - 1 - back]]
        if len(matches):
            start = int(matches[0]) + 1  # the first occurrence: the smallest end
            return ids[start : start + k].tolist()
    return []
