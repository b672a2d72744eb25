"""The kinds of value a request field may take: the vocabulary the one validation
(`pagedserve.common.validation`) declares its fields in.

Each rule checks a Python value as a caller gives it (JSON decoded by the gateway, keyword
arguments of `SamplingParams`, a field of a parsed `GenerateRequest`, a command-line word) and
returns it normalized, or raises `RuleError` saying what was expected. Types are strict, as OpenAI's
API is: a string is not a number, a bool is not an integer and 5.0 is not one either, so the same
value gets the same verdict from every door. Each rule also gives its text form (`from_text`: the
command line, whose words are all strings), its JSON schema (the gateway's OpenAPI description)
and a one-line description (docs/input-validation.md).
"""

from __future__ import annotations

import math
import numbers
import re
import struct
from dataclasses import dataclass
from typing import Any

from pagedserve.protos.wire import (
    FLOAT32_MAX,
    INT32_MAX,
    INT32_MIN,
    MAX_PROMPT_CHARS,
    MAX_TOKEN_IDS,
    UINT32_MAX,
    UINT64_MAX,
)

# How many offending values a message lists, and how long a shown value may be: a message is
# echoed in a gRPC status (16 KiB of metadata at most) and in HTTP bodies.
SHOWN_VALUES = 8
SHOWN_CHARS = 60

_BOUND_NAMES = {
    INT32_MIN: "-2^31",
    INT32_MAX: "2^31-1",
    UINT32_MAX: "2^32-1",
    UINT64_MAX: "2^64-1",
    FLOAT32_MAX: "3.4e38",
    MAX_PROMPT_CHARS: "4 Mi",
    MAX_TOKEN_IDS: "1 Mi",
}


class RuleError(ValueError):
    """A value a rule refuses; the message says what was expected (the caller names the field)."""


def shown(value: Any) -> str:
    """`value` as a message shows it: its repr, cut to SHOWN_CHARS characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _bound(value: float) -> str:
    return _BOUND_NAMES.get(value, f"{value:g}" if isinstance(value, float) else str(value))


def _is_integer(value: Any) -> bool:
    """An int (numpy's integers too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_utf8(value: str) -> None:
    """Strings travel as UTF-8 (proto3 `string`, JSON): a lone surrogate (what Python makes of
    bytes that are not UTF-8, on a command line or in a JSON escape) has no UTF-8 form."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RuleError(f"is not valid UTF-8 (a lone surrogate at character {exc.start})") from None


class Rule:
    """One kind of value. Subclasses are frozen dataclasses; `check` is all a door needs."""

    # How `pagedserve generate` takes the field: one word, repeated words, or a flag without one.
    cli_action = "store"

    def check(self, value: Any) -> Any:
        """The value normalized; raises RuleError."""
        raise NotImplementedError

    def from_text(self, text: Any) -> Any:
        """A command-line word (a list of them for repeated flags) as the value it spells; what does
        not parse is returned as it is, for `check` to refuse with the usual message."""
        return text

    def describe(self) -> str:
        raise NotImplementedError

    def json_schema(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class Integer(Rule):
    """An integer in [lo, hi]; `hint` says why the range is what it is."""

    lo: int
    hi: int
    hint: str = ""

    def check(self, value: Any) -> int:
        if not _is_integer(value) or not self.lo <= value <= self.hi:
            raise RuleError(f"must be {self.describe()}{self.hint}, got {shown(value)}")
        return int(value)

    def from_text(self, text: Any) -> Any:
        try:
            return int(text)
        except (TypeError, ValueError):
            return text

    def describe(self) -> str:
        if self.lo == self.hi:
            return f"{self.lo}"
        return f"an integer in [{_bound(self.lo)}, {_bound(self.hi)}]"

    def json_schema(self) -> dict[str, Any]:
        return {"type": "integer", "minimum": self.lo, "maximum": self.hi}


@dataclass(frozen=True)
class Number(Rule):
    """A finite number in [lo, hi] (`lo_open`: (lo, hi]), carried as a 32-bit float: it is
    checked as the wire will carry it, rounded to float32 (1e-50 is 0 there, 1e39 does not fit)."""

    lo: float
    hi: float = FLOAT32_MAX
    lo_open: bool = False

    def check(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RuleError(f"must be {self.describe()}, got {shown(value)}")
        try:
            number = float(value)
            finite = math.isfinite(number)
            if finite:  # as the wire carries it; beyond the largest float32, struct raises or gives inf
                number = struct.unpack("f", struct.pack("f", number))[0]
                finite = math.isfinite(number)
        except OverflowError:
            finite = False
        if not finite:
            raise RuleError(f"must be {self.describe()} and fit a 32-bit float, got {shown(value)}")
        low_ok = number > self.lo if self.lo_open else number >= self.lo
        if not low_ok or number > self.hi:
            raise RuleError(f"must be {self.describe()}, got {shown(value)}")
        return number

    def from_text(self, text: Any) -> Any:
        try:
            return float(text)
        except (TypeError, ValueError):
            return text

    def describe(self) -> str:
        if self.hi == FLOAT32_MAX:
            return f"a number {'>' if self.lo_open else '>='} {_bound(self.lo)}"
        return f"a number in {'(' if self.lo_open else '['}{_bound(self.lo)}, {_bound(self.hi)}]"

    def json_schema(self) -> dict[str, Any]:
        low = "exclusiveMinimum" if self.lo_open else "minimum"
        return {"type": "number", low: self.lo, "maximum": self.hi}


@dataclass(frozen=True)
class Boolean(Rule):
    cli_action = "store_true"

    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise RuleError(f"must be true or false, got {shown(value)}")
        return value

    def describe(self) -> str:
        return "true or false"

    def json_schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


@dataclass(frozen=True)
class Text(Rule):
    """A UTF-8 string of at most `max_chars` characters (`non_empty`: at least one)."""

    max_chars: int | None = None
    non_empty: bool = False

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise RuleError(f"must be a string, got {shown(value)}")
        if self.non_empty and not value:
            raise RuleError("must not be empty")
        if self.max_chars is not None and len(value) > self.max_chars:
            raise RuleError(f"has {len(value)} characters, more than {self.max_chars}")
        _check_utf8(value)
        return value

    def describe(self) -> str:
        limits = [f"at most {self.max_chars} characters"] if self.max_chars is not None else []
        if self.non_empty:
            limits.insert(0, "not empty")
        return "a string" + (f" ({', '.join(limits)})" if limits else "")

    def json_schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "string"}
        if self.max_chars is not None:
            schema["maxLength"] = self.max_chars
        if self.non_empty:
            schema["minLength"] = 1
        return schema


@dataclass(frozen=True)
class TextList(Rule):
    """Up to `max_items` non-empty UTF-8 strings of at most `max_chars` characters each; one string
    alone counts as a list of it (OpenAI's and vLLM's `stop`)."""

    max_items: int
    max_chars: int
    cli_action = "append"

    def check(self, value: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
            raise RuleError(f"must be a string or a list of strings, got {shown(value)}")
        if len(items) > self.max_items:
            raise RuleError(f"has {len(items)} strings; at most {self.max_items} are allowed")
        for s in items:
            if not s:
                raise RuleError("must not contain an empty string")
            if len(s) > self.max_chars:
                raise RuleError(f"has a string of {len(s)} characters; at most {self.max_chars} are allowed")
            _check_utf8(s)
        return tuple(items)

    def describe(self) -> str:
        return (
            f"a string or a list of at most {self.max_items} non-empty strings of at most "
            f"{self.max_chars} characters"
        )

    def json_schema(self) -> dict[str, Any]:
        item = {"type": "string", "minLength": 1, "maxLength": self.max_chars}
        return {"anyOf": [item, {"type": "array", "items": item, "maxItems": self.max_items}]}


_SEPARATORS = re.compile(r"[,\s]+")


@dataclass(frozen=True)
class IntList(Rule):
    """A list of integers in [lo, hi] (token ids): `non_empty`, at most `max_distinct` distinct."""

    lo: int = 0
    hi: int = UINT32_MAX
    max_distinct: int | None = None
    non_empty: bool = False
    max_items: int = MAX_TOKEN_IDS
    cli_action = "append"

    def check(self, value: Any) -> tuple[int, ...]:
        if not isinstance(value, list | tuple):
            raise RuleError(f"must be {self.describe()}, got {shown(value)}")
        if len(value) > self.max_items:
            raise RuleError(f"has {len(value)} ids; at most {self.max_items} are allowed")
        if not all(type(i) is int for i in value):  # the fast path: plain ints
            bad = [i for i in value if not _is_integer(i)]
            if bad:
                raise RuleError(f"must be {self.describe()}, got {shown(bad[0])} in it")
            value = [int(i) for i in value]
        if self.non_empty and not value:
            raise RuleError("must not be empty")
        if value and (min(value) < self.lo or max(value) > self.hi):
            bad = [i for i in value if not self.lo <= i <= self.hi][:SHOWN_VALUES]
            raise RuleError(f"must be {self.describe()}; {shown(bad)} are not")
        if self.max_distinct is not None and len(distinct := set(value)) > self.max_distinct:
            raise RuleError(f"has {len(distinct)} distinct ids; at most {self.max_distinct} are allowed")
        return tuple(value)

    def from_text(self, text: Any) -> Any:
        """Comma- or space-separated integers; a repeated flag's words are joined."""
        words = text if isinstance(text, list) else [text]
        if not all(isinstance(w, str) for w in words):
            return text
        parts = [p for w in words for p in _SEPARATORS.split(w.strip()) if p]
        return [Integer(self.lo, self.hi).from_text(p) for p in parts]

    def describe(self) -> str:
        kind = "a non-empty list" if self.non_empty else "a list"
        limit = f", at most {self.max_distinct} distinct" if self.max_distinct is not None else ""
        return f"{kind} of integers in [{_bound(self.lo)}, {_bound(self.hi)}]{limit}"

    def json_schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {
            "maxItems": self.max_items,
            "type": "array",
            "items": {"type": "integer", "minimum": self.lo, "maximum": self.hi},
        }
        if self.non_empty:
            schema["minItems"] = 1
        return schema


@dataclass(frozen=True)
class Prompt(Rule):
    """A non-empty UTF-8 text, or a non-empty list of token ids. Whitespace-only text is a prompt
    (it tokenizes to tokens); the empty one is refused, as vLLM's OpenAI server refuses it."""

    text: Text = Text(max_chars=MAX_PROMPT_CHARS, non_empty=True)
    token_ids: IntList = IntList(non_empty=True)

    def check(self, value: Any) -> str | tuple[int, ...]:
        if isinstance(value, str):
            return self.text.check(value)
        if isinstance(value, list | tuple):
            return self.token_ids.check(value)
        raise RuleError(f"must be {self.describe()}, got {shown(value)}")

    def describe(self) -> str:
        return (
            f"a non-empty string of at most {_bound(MAX_PROMPT_CHARS)} characters, or a non-empty list "
            f"of at most {_bound(MAX_TOKEN_IDS)} token ids (integers in [0, 2^32-1])"
        )

    def json_schema(self) -> dict[str, Any]:
        return {"anyOf": [self.text.json_schema(), self.token_ids.json_schema()]}
