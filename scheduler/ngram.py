"""N-gram (prompt lookup) proposals for speculative decoding, as vLLM's NgramProposer makes them.

The scheduler holds every request's tokens, so it proposes: take the request's last n tokens, for n
from prompt_lookup_max down to prompt_lookup_min; at the first n whose n-gram occurred earlier in
prompt + output, propose the (up to) k tokens that followed its first occurrence. Outputs that copy
their prompt (edits, extraction, code rewrites) are then mostly proposed right.

It runs for every speculating request at every step, on the scheduler's CPU, so it is kept cheap:
each request's tokens live in a NumPy array that grows with its outputs (`NgramProposer`), and the
search compares the whole history with one token only (the last), then checks the few positions
that match it against the rest of the n-gram: ~16 us for 1,200 tokens, against ~120 us for
comparing every window of the history.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedserve.scheduler.request import Request, SeqId


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


class NgramProposer:
    """`propose_ngram` over each request's tokens, kept as a growing NumPy array per request (the
    scheduler calls `forget` when a request ends)."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._tokens: dict[SeqId, tuple[np.ndarray, int]] = {}  # buffer, tokens in it
        self._matched: dict[SeqId, tuple[int, bool]] = {}  # known tokens, whether they matched

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to `k` tokens to follow the request's known tokens."""
        return propose_ngram(self._known(request), k, self.lookup_min, self.lookup_max)

    def matches(self, request: Request) -> bool:
        """Whether the request's known tokens end in an n-gram seen before (memoized per length):
        the scheduler holds back for proposals only requests that are copying."""
        known = request.num_known_tokens
        memo = self._matched.get(request.seq_id)
        if memo is not None and memo[0] == known:
            return memo[1]
        matched = bool(self.propose(request, 1))
        self._matched[request.seq_id] = (known, matched)
        return matched

    def forget(self, seq_id: SeqId) -> None:
        self._tokens.pop(seq_id, None)
        self._matched.pop(seq_id, None)

    def _known(self, request: Request) -> np.ndarray:
        """The request's known tokens (prompt, then outputs), appended to its array as they come."""
        known = request.num_known_tokens
        entry = self._tokens.get(request.seq_id)
        if entry is None:
            buffer = np.empty(max(64, 2 * known), dtype=np.int64)
            buffer[: request.num_prompt_tokens] = request.prompt_token_ids
            entry = (buffer, request.num_prompt_tokens)
        buffer, filled = entry
        if filled < known:
            if known > len(buffer):
                grown = np.empty(2 * known, dtype=np.int64)
                grown[:filled] = buffer[:filled]
                buffer = grown
            num_prompt = request.num_prompt_tokens
            buffer[filled:known] = request.output_token_ids[filled - num_prompt : known - num_prompt]
        elif filled > known:  # outputs were taken back (never today): start again
            self._tokens.pop(request.seq_id)
            return self._known(request)
        self._tokens[request.seq_id] = (buffer, known)
        return buffer[:known]
