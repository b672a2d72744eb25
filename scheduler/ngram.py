"""The scheduler's n-gram proposals: `pagedserve.common.ngram.propose_ngram` (the search, shared with
the executor) over each request's tokens, which the scheduler holds, kept as a growing NumPy array
per request (`NgramProposer`).
"""

from __future__ import annotations

import numpy as np

from pagedserve.common.ngram import propose_ngram
from pagedserve.scheduler.request import Request, SeqId

__all__ = ["NgramProposer"]


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
