"""The one validation of a generation request: every door (gRPC, the OpenAI gateway, `pagedserve
generate`, `LLM`/`SamplingParams`) checks what it was given here, so the same input gets the same
verdict everywhere. Each door maps `InvalidRequest` to its own form (INVALID_ARGUMENT, HTTP 400,
exit status 2, ValueError); docs/input-validation.md states the rules.

The fields are declared once, as the attributes of `RequestParams`: each with its rule (the kind
and range of its value, `pagedserve.common.rules`), its default, what it means, where it travels in
a `GenerateRequest` and its `pagedserve generate` flag. To add a field (a JSON schema, a grammar, a
speculation setting): one `declare(...)` line in `RequestParams`, where in the order of checks it
belongs, and a `CROSS_FIELD_CHECKS` entry if it constrains another field. The wire (`to_proto`,
`values_from_proto`) and the command line (`wire=`, `flag=`) follow from the declaration; the
gateway takes a body field of the same name declared `checked("name")` (entrypoints/openai/
protocol.py), `SamplingParams` an attribute in `request_values`; tests/test_input_validation.py
fails until the docs' table and the doors keep up.

What needs the model (a prompt longer than max_model_len, token ids beyond the vocabulary) is not
here: the scheduler, which every door reaches, checks it (`pagedserve.scheduler.admission`) and
refuses with the same `InvalidRequest`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.rules import (
    Boolean,
    Integer,
    IntList,
    Number,
    Prompt,
    Rule,
    RuleError,
    Text,
    TextList,
)
from pagedserve.common.structured_outputs import StructuredOutputs, StructuredOutputsRule
from pagedserve.protos import generation_pb2
from pagedserve.protos.wire import (
    FLOAT32_MAX,
    INT32_MAX,
    INT32_MIN,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    UINT32_MAX,
    UINT64_MAX,
)

_SPEC = "pagedserve.spec"


class InvalidRequest(ValueError):
    """A request that can never be served: `field` names the field, the message says why
    (`"max_tokens: must be an integer in [1, 2^32-1], got 0"`); every door keeps that form, so
    that a refusal relayed from the scheduler still names its field (`field_named`)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# ---- where a field travels in a GenerateRequest ------------------------------------------------


@dataclass(frozen=True)
class WirePath:
    """A field of GenerateRequest by its dotted path; None puts nothing (the server's default)."""

    path: str

    def _parent(self, request: Any) -> tuple[Any, str]:
        *parents, name = self.path.split(".")
        for parent in parents:
            request = getattr(request, parent)
        return request, name

    def put(self, request: generation_pb2.GenerateRequest, value: Any) -> None:
        if value is None:
            return
        message, name = self._parent(request)
        if message.DESCRIPTOR.fields_by_name[name].is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)

    def get(self, request: generation_pb2.GenerateRequest) -> Any:
        message, name = self._parent(request)
        descriptor = message.DESCRIPTOR.fields_by_name[name]
        if descriptor.is_repeated:
            return list(getattr(message, name))
        if descriptor.has_presence and not message.HasField(name):
            return None
        return getattr(message, name)


class PromptWire:
    """The prompt is a oneof: `text`, or `token_ids.ids`."""

    path = "text|token_ids"

    def put(self, request: generation_pb2.GenerateRequest, value: Any) -> None:
        if isinstance(value, str):
            request.text = value
        elif value is not None:
            request.token_ids.ids.extend(value)

    def get(self, request: generation_pb2.GenerateRequest) -> Any:
        which = request.WhichOneof("prompt")
        if which == "text":
            return request.text
        return list(request.token_ids.ids) if which == "token_ids" else None


class StructuredOutputWire:
    """`structured_output`: a oneof of the constraint kinds, plus disable_any_whitespace."""

    path = "structured_output"
    _WIRE_NAMES = {
        "json": "json_schema",
        "json_object": "json_object",
        "regex": "regex",
        "grammar": "grammar",
    }

    def put(self, request: generation_pb2.GenerateRequest, value: Any) -> None:
        if value is None:
            return
        out = request.structured_output
        if value.kind == "choice":
            out.choice.choices.extend(value.value)
        elif value.kind == "json_object":
            out.json_object = True
        else:
            setattr(out, self._WIRE_NAMES[value.kind], value.value)
        out.disable_any_whitespace = value.disable_any_whitespace

    def get(self, request: generation_pb2.GenerateRequest) -> Any:
        if not request.HasField("structured_output"):
            return None
        wire = request.structured_output
        which = wire.WhichOneof("kind")
        if which is None:  # only the option set: the rule refuses it, naming what is missing
            return {"disable_any_whitespace": wire.disable_any_whitespace}
        kind = {v: k for k, v in self._WIRE_NAMES.items()}.get(which, which)
        value: Any = list(wire.choice.choices) if which == "choice" else getattr(wire, which)
        return {kind: value, "disable_any_whitespace": wire.disable_any_whitespace}


class LogprobsWire:
    """The wire asks for the sampled token's logprob or not (`return_logprobs`): logprobs 0 or 1."""

    path = "return_logprobs"

    def put(self, request: generation_pb2.GenerateRequest, value: Any) -> None:
        request.return_logprobs = value is not None

    def get(self, request: generation_pb2.GenerateRequest) -> Any:
        return 0 if request.return_logprobs else None


Wire = WirePath | PromptWire | LogprobsWire | StructuredOutputWire


@dataclass(frozen=True)
class FieldSpec:
    """One field's declaration (see `declare`)."""

    name: str
    rule: Rule
    default: Any
    required: bool
    doc: str
    wire: Wire | None
    flag: str | None
    normalize: Callable[[Any], Any] | None


def declare(
    rule: Rule,
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    wire: str | Wire | None = None,
    flag: str | None = None,
    normalize: Callable[[Any], Any] | None = None,
) -> Any:
    """A `RequestParams` attribute: its rule; its default (None or missing: the value a door that
    leaves it out, or gives null/None, gets; no default: required); what it means; its place in a
    GenerateRequest (None: it has none, so the only value it may take is its default); its
    `pagedserve generate` flag (None: not on the command line); `normalize`: the value as the
    engine takes it (vLLM's top_k -1 means 0, off)."""
    if isinstance(wire, str):
        wire = WirePath(wire)
    spec = {"rule": rule, "doc": doc, "wire": wire, "flag": flag, "normalize": normalize}
    return field(default=default, metadata={_SPEC: spec})


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestParams:
    """A request that passed the validation. Unset optional fields are None: the server's default
    (temperature 1, top_p 1, top_k off, max_tokens up to max_model_len, a random seed).

    The order of the fields is the order of the checks, so that every door reports the same field
    of a request with several bad ones: `SamplingParams`' fields first (`LLM` checks them when
    they are made, before it sees a prompt), then the others.
    """

    max_tokens: int | None = declare(
        Integer(1, UINT32_MAX),
        None,
        doc="the most tokens to generate; unset: up to max_model_len. The scheduler refuses a "
        "prompt + max_tokens beyond max_model_len",
        wire="stopping.max_tokens",
        flag="--max-tokens",
    )
    min_tokens: int = declare(
        Integer(0, UINT32_MAX),
        0,
        doc="tokens generated before EOS or a stop token may end the completion; at most max_tokens",
        wire="stopping.min_tokens",
        flag="--min-tokens",
    )
    temperature: float | None = declare(
        Number(0.0, FLOAT32_MAX),
        None,
        doc="0 is greedy; unset: 1",
        wire="sampling.temperature",
        flag="--temperature",
    )
    top_p: float | None = declare(
        Number(0.0, 1.0, lo_open=True),
        None,
        doc="nucleus sampling mass; unset: 1",
        wire="sampling.top_p",
        flag="--top-p",
    )
    top_k: int | None = declare(
        Integer(-1, INT32_MAX),
        None,
        doc="keep the k most likely tokens; 0 or -1 (vLLM's off) disables it, as does a k beyond "
        "the vocabulary",
        wire="sampling.top_k",
        flag="--top-k",
        normalize=lambda k: max(k, 0),
    )
    seed: int | None = declare(
        Integer(0, UINT64_MAX),
        None,
        doc="the same seed and prompt give the same tokens",
        wire="sampling.seed",
        flag="--seed",
    )
    stop: tuple[str, ...] = declare(
        TextList(MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS),
        (),
        doc="strings that end the completion (not included in its text)",
        wire="stopping.stop",
        flag="--stop",
    )
    stop_token_ids: tuple[int, ...] = declare(
        IntList(0, UINT32_MAX, max_distinct=MAX_STOP_TOKEN_IDS),
        (),
        doc="token ids that end the completion besides EOS; the scheduler refuses ids beyond the vocabulary",
        wire="stopping.stop_token_ids",
        flag="--stop-token-ids",
    )
    ignore_eos: bool = declare(
        Boolean(), False, doc="keep generating after EOS", wire="stopping.ignore_eos", flag="--ignore-eos"
    )
    logprobs: int | None = declare(
        Integer(0, 1, hint=" (only the sampled token's logprob is returned)"),
        None,
        doc="0 or 1: return the sampled token's logprob with each token (`generate` prints their sum)",
        wire=LogprobsWire(),
        flag="--logprobs",
    )
    n: int = declare(
        Integer(1, 1, hint=" (one completion per request is supported)"), 1, doc="completions per prompt"
    )
    structured_outputs: StructuredOutputs | None = declare(
        StructuredOutputsRule(),
        None,
        doc="constrains the output to a JSON schema, any JSON object, a regex, one of some strings or "
        "an EBNF grammar (docs/structured-outputs.md); the scheduler refuses what does not compile",
        wire=StructuredOutputWire(),
        flag="--structured-outputs",
    )
    priority: int = declare(
        Integer(INT32_MIN, INT32_MAX),
        0,
        doc="lower runs sooner; ties go by arrival",
        wire="priority",
        flag="--priority",
    )
    prompt: str | tuple[int, ...] = declare(
        Prompt(),
        doc="the text (whitespace alone is a prompt: it tokenizes to tokens), or its token ids",
        wire=PromptWire(),
    )
    request_id: str = declare(
        Text(max_chars=MAX_REQUEST_ID_CHARS),
        "",
        doc="echoed in every streamed message; empty: the scheduler makes one (gRPC only)",
        wire="request_id",
    )


def _specs() -> dict[str, FieldSpec]:
    specs = {}
    for f in dataclasses.fields(RequestParams):
        meta = f.metadata[_SPEC]
        required = f.default is dataclasses.MISSING
        specs[f.name] = FieldSpec(f.name, default=None if required else f.default, required=required, **meta)
    return specs


FIELDS: dict[str, FieldSpec] = _specs()
"""Every field, in the order they are checked (the first bad one is the one reported)."""


def _min_tokens_within_max_tokens(values: Mapping[str, Any]) -> None:
    max_tokens, min_tokens = values.get("max_tokens"), values.get("min_tokens")
    if max_tokens is not None and min_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest("min_tokens", f"({min_tokens}) exceeds max_tokens ({max_tokens})")


def _no_min_tokens_with_a_constraint(values: Mapping[str, Any]) -> None:
    """A grammar decides where the output may end (EOS is allowed only there): banning EOS until
    min_tokens could leave a constrained request no token it may sample."""
    if values.get("structured_outputs") is not None and values.get("min_tokens"):
        raise InvalidRequest(
            "structured_outputs", "cannot be combined with min_tokens (the grammar decides where it ends)"
        )


CROSS_FIELD_CHECKS: dict[str, tuple[Callable[[Mapping[str, Any]], None], ...]] = {
    "min_tokens": (_min_tokens_within_max_tokens,),
    "structured_outputs": (_no_min_tokens_with_a_constraint,),
}
"""Rules over several fields, by the field after whose own check they run (the last one they
read, so that the order of checks stays the order of the fields); each skips fields not given."""


# ---- the validation ----------------------------------------------------------------------------


def check_fields(values: Mapping[str, Any], *, from_text: bool = False) -> dict[str, Any]:
    """Checks the fields in `values` (None: the field's default; a required one is refused), in
    declaration order; returns them normalized. `from_text`: the values are command-line words
    (`Rule.from_text`). Raises InvalidRequest naming the first bad field; TypeError for a name that
    is no field (a door's bug: doors pass only the fields they know)."""
    unknown = sorted(values.keys() - FIELDS.keys())
    if unknown:
        raise TypeError(f"not request fields: {', '.join(unknown)}")
    checked: dict[str, Any] = {}
    for name, spec in FIELDS.items():
        if name not in values:
            continue
        value = values[name]
        if value is None:
            if spec.required:
                raise InvalidRequest(name, "must be given")
            checked[name] = spec.default
        else:
            if from_text:
                value = spec.rule.from_text(value)
            try:
                value = spec.rule.check(value)
            except RuleError as exc:
                raise InvalidRequest(name, str(exc)) from None
            checked[name] = spec.normalize(value) if spec.normalize is not None else value
        for check in CROSS_FIELD_CHECKS.get(name, ()):
            check(checked)
    return checked


def validate_request(values: Mapping[str, Any], *, from_text: bool = False) -> RequestParams:
    """A whole request: `check_fields` (a required field left out is refused in its turn), then the
    defaults of the fields not given."""
    required = {name: None for name, spec in FIELDS.items() if spec.required}
    return RequestParams(**check_fields(required | dict(values), from_text=from_text))


def field_named(message: str) -> str | None:
    """The field an InvalidRequest's message names (`"top_p: must be ..."`), else None."""
    match = re.match(r"(\w+): ", message)
    return match.group(1) if match and match.group(1) in FIELDS else None


# ---- the wire ----------------------------------------------------------------------------------


def to_proto(params: RequestParams) -> generation_pb2.GenerateRequest:
    """The GenerateRequest of a validated request: every value fits its wire type."""
    request = generation_pb2.GenerateRequest()
    for name, spec in FIELDS.items():
        if spec.wire is not None:
            spec.wire.put(request, getattr(params, name))
    return request


def values_from_proto(request: generation_pb2.GenerateRequest) -> dict[str, Any]:
    """What a GenerateRequest carries, field by field, for `validate_request` (unset: None)."""
    return {name: spec.wire.get(request) for name, spec in FIELDS.items() if spec.wire is not None}


def field_of_wire_path(path: str) -> str:
    """The field a GenerateRequest's field (`stopping.stop`, `text`) carries; else the path."""
    for name, spec in FIELDS.items():
        if spec.wire is not None and path in spec.wire.path.split("|"):
            return name
    return path.split(".")[0] if path.split(".")[0] in FIELDS else path


# ---- the reference -----------------------------------------------------------------------------


def reference_table() -> str:
    """The fields as a markdown table (docs/input-validation.md carries it; a test keeps it current)."""
    rows = ["| Field | Value | Default | Meaning |", "|---|---|---|---|"]
    for name, spec in FIELDS.items():
        if spec.required:
            default = "required"
        elif spec.default is None or spec.default == ():
            default = "unset" if spec.default is None else "none"
        else:
            default = f"`{spec.default!r}`"
        flag = f" (`{spec.flag}`)" if spec.flag else ""
        rows.append(f"| `{name}`{flag} | {spec.rule.describe()} | {default} | {spec.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_table())
