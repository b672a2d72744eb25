"""Turns each request's sampled tokens into the deltas its client receives, and decides when it stops.

One `Completion` per request. It owns the request's stop conditions (EOS, stop token ids, stop
strings, max_tokens, min_tokens) and its detokenizer, and it holds back just enough text that a
stop string split across tokens is never streamed (the text the client gets never contains it).

With `stream_interval` N > 1 (`--stream-interval`, as vLLM's) it also holds tokens back until N
are waiting; the first token (time to first token) and the last are never held. A request without
stop strings is then detokenized once per message, not once per token: only stop strings need the
text of every token as it comes, and detokenizing is the largest per-token cost of the scheduler.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.scheduler.detokenizer import IncrementalDetokenizer, Tokenizer


class FinishReason(enum.IntEnum):
    """Values match `pagedserve.v1.FinishReason`."""

    LENGTH = 1
    STOP = 2
    ABORT = 3


@dataclass(frozen=True)
class StopConditions:
    """What ends a request; validated by the service before it gets here."""

    max_tokens: int
    min_tokens: int = 0
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # EOS ids included unless ignore_eos


@dataclass
class Delta:
    """What one GenerateResponse carries."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def merged(self, later: Delta) -> Delta:
        """This delta followed by `later`, as one message."""
        return Delta(
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs,
            finish_reason=later.finish_reason,
        )


class Completion:
    """Output state of one request: generated tokens, text streamed so far, and whether it ended."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: StopConditions,
        stream_interval: int = 1,
    ) -> None:
        self.stop = stop
        self.stream_interval = stream_interval
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._text = ""  # all text decoded so far, cut at a stop string once one is found
        self._emitted = 0  # characters of _text already sent
        self._holdback = max((len(s) for s in stop.stop_strings), default=1) - 1
        self._held_ids: list[int] = []  # tokens not streamed yet
        self._held_logprobs: list[float] = []
        self._undecoded: list[int] = []  # held tokens not detokenized yet (no stop strings)

    def add_token(
        self, token_id: int, logprob: float | None = None, grammar_ended: bool = False
    ) -> Delta | None:
        """Accounts for one sampled token; returns the delta to stream now, or None while the
        token is held back (see the module doc). `grammar_ended`: the token completed the request's
        grammar (structured outputs: the stop token where the grammar may end), which ends it as a
        stop token does, even with ignore_eos."""
        if self.finish_reason is not None:
            raise RuntimeError("token added to a finished completion")
        self.num_tokens += 1
        self._held_ids.append(token_id)
        if logprob is not None:
            self._held_logprobs.append(logprob)
        stop = self.stop
        may_stop = self.num_tokens >= stop.min_tokens
        if grammar_ended or (may_stop and token_id in stop.stop_token_ids):
            self.finish_reason = FinishReason.STOP  # the stop token's own text is not streamed
        elif stop.stop_strings:
            self._text += self._detokenizer.add(token_id)
            if may_stop and self._cut_at_stop_string():
                self.finish_reason = FinishReason.STOP
        else:
            self._undecoded.append(token_id)
        if self.finish_reason is None and self.num_tokens >= stop.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        final = self.finish_reason is not None
        if not final and len(self._held_ids) < self.stream_interval and self.num_tokens > 1:
            return None
        return self._release_held(final)

    def abort(self) -> Delta:
        """Ends the completion early (client gone, executor lost, shutdown); the delta carries what
        was held back."""
        self.finish_reason = FinishReason.ABORT
        return self._release_held(final=True)

    def _release_held(self, final: bool) -> Delta:
        """The held tokens as one delta: detokenized in one step (those not decoded yet), the
        detokenizer flushed at max_tokens, the text that may be streamed now."""
        if self._undecoded:
            self._text += self._detokenizer.add_many(self._undecoded)
            self._undecoded = []
        if self.finish_reason is FinishReason.LENGTH:
            self._text += self._detokenizer.flush()
        delta = Delta(self._held_ids, self._take_text(final), self._held_logprobs, self.finish_reason)
        self._held_ids, self._held_logprobs = [], []
        return delta

    def _cut_at_stop_string(self) -> bool:
        # A stop string can only end in text not yet streamed, and can start up to its length before.
        search_from = max(0, self._emitted - self._holdback)
        hits = [i for s in self.stop.stop_strings if (i := self._text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self._text = self._text[: min(hits)]
        return True

    def _take_text(self, final: bool) -> str:
        end = len(self._text) if final else max(self._emitted, len(self._text) - self._holdback)
        chunk = self._text[self._emitted : end]
        self._emitted = end
        return chunk
