"""Incremental detokenization that never emits broken UTF-8.

Byte-level BPE tokens can end in the middle of a multi-byte character, and SentencePiece decodes a
token differently depending on what precedes it. So each delta is the difference between decoding
a short window that ends at the newest token and the same window without the unread tokens; the
window only advances when the decoded text does not end in a replacement character.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

# How many tokens before the first new one give SentencePiece its context (leading spaces).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def decode_function(tokenizer: Tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` as one callable.

    For a Hugging Face fast tokenizer that neither overrides decoding nor cleans up spaces, that is
    exactly its Rust tokenizer's decode, called directly: the Python layers around it cost twice
    the decoding itself, twice per generated token.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        from transformers import PreTrainedTokenizerFast

        cls = type(tokenizer)
        if (
            isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode
        ):
            return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]) -> None:
        self._decode_ids = decode_function(tokenizer)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = len(self._ids)  # tokens before this are already emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_ids(self._ids[start:end])

    def add(self, token_id: int) -> str:
        """Appends a token; returns the newly complete text (possibly empty)."""
        return self.add_many((token_id,))

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Appends tokens; returns the newly complete text of all of them (possibly empty): two
        decodes for the lot, where `add` takes two per token."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of generation: whatever is still held back, replacement characters included."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
