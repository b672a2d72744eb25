"""`--speculative-config`: speculative decoding's settings, vLLM's shape, shared by the scheduler
(method, k, the n-gram lookup, disable_by_batch_size) and the executor (the draft model).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "DIR", "num_speculative_tokens": 4}

either with an optional "disable_by_batch_size": B (no speculation while more than B requests run).
Every field is checked with the rules of the one validation (`pagedserve.common.rules`), and a
refusal names the field: "speculative_config.num_speculative_tokens: must be an integer in [1, 16],
got 0". See docs/speculative-decoding.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pagedserve.common.rules import Integer, RuleError, Text

METHODS = ("ngram", "draft_model")
# More proposals per step than this only cost verification work: acceptance falls geometrically
# with the position, and a step's query grows by k + 1 tokens per request.
MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 64

_PREFIX = "speculative_config"
_K = Integer(1, MAX_SPECULATIVE_TOKENS)
_LOOKUP = Integer(1, MAX_LOOKUP)
_BATCH = Integer(1, 1 << 20)
_MODEL = Text(max_chars=4096, non_empty=True)
_FIELDS = {
    "ngram": {
        "method",
        "num_speculative_tokens",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "disable_by_batch_size",
    },
    "draft_model": {"method", "model", "num_speculative_tokens", "disable_by_batch_size"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated at construction (ValueError naming `speculative_config.FIELD`).

    Attributes:
        method: "ngram" (prompt lookup, in the scheduler) or "draft_model" (a small model run by the
            executor beside the target).
        num_speculative_tokens: k, the tokens proposed per step and verified in one forward.
        prompt_lookup_max / prompt_lookup_min: ngram: the longest and shortest suffix n-gram
            looked up in the request's earlier tokens (longest first).
        model: draft_model: the draft's checkpoint directory (same tokenizer; the same KV heads
            and head_dim as the target).
        disable_by_batch_size: no speculation in a step while more than this many requests run
            (None: always on).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _check("method", self.method, Text(non_empty=True))
        if self.method not in METHODS:
            raise ValueError(f"{_PREFIX}.method: must be one of {', '.join(METHODS)}, got {self.method!r}")
        _check("num_speculative_tokens", self.num_speculative_tokens, _K)
        if self.disable_by_batch_size is not None:
            _check("disable_by_batch_size", self.disable_by_batch_size, _BATCH)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(f"{_PREFIX}.model: only the draft_model method takes a model")
            if self.prompt_lookup_max is None:
                raise ValueError(f"{_PREFIX}.prompt_lookup_max: the ngram method needs it")
            _check("prompt_lookup_max", self.prompt_lookup_max, _LOOKUP)
            lookup_min = self.prompt_lookup_min if self.prompt_lookup_min is not None else 1
            at_most_max = Integer(1, self.prompt_lookup_max, " (<= prompt_lookup_max)")
            _check("prompt_lookup_min", lookup_min, at_most_max)
            object.__setattr__(self, "prompt_lookup_min", lookup_min)
        else:
            if self.model is None:
                raise ValueError(f"{_PREFIX}.model: the draft_model method needs the draft's directory")
            _check("model", self.model, _MODEL)
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{_PREFIX}.{name}: only the ngram method takes it")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a verification step holds past its own, for the verification after it: k + 1
        with a draft model, whose executor launches that step before its plan comes (with the
        blocks its request holds then); 0 with n-gram proposals, which come with the plan. The
        scheduler and the executor trim a verified request's tables to the same end with it."""
        return self.num_speculative_tokens + 1 if self.method == "draft_model" else 0

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the flag's JSON text or a dict (`LLM(speculative_config=...)`); ValueError naming
        the field for anything else."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{_PREFIX}: not JSON ({exc})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"{_PREFIX}: must be a JSON object, got {type(value).__name__}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"{_PREFIX}.method: must be one of {', '.join(METHODS)}, got {method!r}")
        unknown = sorted(set(value) - _FIELDS[method])
        if unknown:
            raise ValueError(
                f"{_PREFIX}.{unknown[0]}: not a field of the {method} method "
                f"(it takes {', '.join(sorted(_FIELDS[method]))})"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError(f"{_PREFIX}.num_speculative_tokens: required")
        return cls(**value)

    def to_json(self) -> str:
        """The flag's text (what `pagedserve serve` forwards)."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, separators=(",", ":"))


def _check(name: str, value: Any, rule: Any) -> None:
    try:
        rule.check(value)
    except RuleError as exc:
        raise ValueError(f"{_PREFIX}.{name}: {exc}") from None


def parse_flag(text: str | None) -> SpeculativeConfig | None:
    """The --speculative-config value (None or empty: off)."""
    return SpeculativeConfig.parse(text) if text else None
