"""Structured outputs as a request field: what a constraint is, and the checks that need no model.

A request may constrain its output to a JSON schema, any JSON object, a regular expression, one of
a list of strings, or an EBNF grammar (vLLM's `StructuredOutputsParams` names: `json`,
`json_object`, `regex`, `choice`, `grammar`). The one validation (`pagedserve.common.validation`)
declares the field `structured_outputs` with the rule `StructuredOutputsRule` here, so every door
refuses the same constraint with the same message. What is checked here needs no tokenizer: the
shape of the value, sizes, that a schema is JSON, and that it uses only what the grammar engine
(xgrammar, in the scheduler) enforces. xgrammar accepts some keywords it then ignores (with a
warning on stderr, or silently: `uniqueItems`, `contains`, `not`, `if`, `multipleOf` on numbers,
unknown `format`s, `oneOf` branches that may overlap): a request with one of those would get output
that does not validate, so they are refused here, naming the keyword and where it is. Regexes and
grammars are compiled by the scheduler, which refuses what does not compile with the same field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pagedserve.common.rules import Rule, RuleError, shown
from pagedserve.protos.wire import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_CONSTRAINT_CHARS

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json", "json_object", "regex", "choice", "grammar")
OPTIONS = ("disable_any_whitespace",)


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A validated constraint. `value`: the schema as compact JSON text (json), the regex, the
    grammar, the choices (a tuple), or None (json_object). `disable_any_whitespace`: JSON without
    free whitespace (", " and ": " only), vLLM's option; a model that pads JSON with whitespace
    otherwise may spend its max_tokens on it."""

    kind: Kind
    value: str | tuple[str, ...] | None = None
    disable_any_whitespace: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The form a caller gives (`{"json": ...}`), which the rule checks back to this value."""
        value: Any = True if self.kind == "json_object" else self.value
        if self.kind == "choice":
            value = list(value)
        out: dict[str, Any] = {self.kind: value}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


# ---- what xgrammar enforces of JSON Schema (probed against xgrammar 0.2.9 by sampling) -----------

_ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
        "readOnly", "writeOnly", "discriminator", "contentEncoding", "contentMediaType", "strict",
    }
)  # fmt: skip
_ENFORCED = frozenset(
    {
        "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minLength", "maxLength", "pattern", "format",
        "items", "prefixItems", "minItems", "maxItems", "uniqueItems",
        "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
        "minProperties", "maxProperties", "unevaluatedProperties", "unevaluatedItems",
    }
)  # fmt: skip
_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# The string formats xgrammar turns into a grammar; any other it ignores.
FORMATS = frozenset(
    {
        "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
        "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("additionalProperties", "propertyNames", "items", "unevaluatedProperties", "unevaluatedItems")


class UnsupportedSchema(RuleError):
    """A JSON schema feature the grammar engine cannot enforce (or a schema that is not one)."""


def check_json_schema(schema: Any) -> None:
    """Refuses a schema that is not an object (or true), or that uses a keyword the grammar engine
    would not enforce; the message names the keyword and its place (`#/properties/tags`)."""
    if schema is True:
        return
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"a JSON schema must be an object, got {shown(schema)}")
    _check(schema, "#", schema)


def _check(node: Any, where: str, root: dict[str, Any]) -> None:
    if isinstance(node, bool):
        return  # true: anything; false: nothing (in items, additionalProperties)
    if not isinstance(node, dict):
        raise UnsupportedSchema(f"{where}: a schema must be an object or a boolean, got {shown(node)}")
    for key, value in node.items():
        if key in _ANNOTATIONS or key.startswith("x-"):
            continue
        if key not in _ENFORCED:
            raise UnsupportedSchema(
                f"{where}: '{key}' is not supported (the grammar engine cannot enforce it)"
            )
        _check_keyword(node, key, value, f"{where}/{key}", root)


def _check_keyword(node: dict[str, Any], key: str, value: Any, where: str, root: dict[str, Any]) -> None:
    if key == "type":
        names = value if isinstance(value, list) else [value]
        if not names or not all(isinstance(n, str) and n in _TYPES for n in names):
            raise UnsupportedSchema(f"{where}: {shown(value)} is not a JSON type")
    elif key in _SUBSCHEMA_MAPS:
        if not isinstance(value, dict):
            raise UnsupportedSchema(f"{where}: must be an object of schemas")
        for name, sub in value.items():
            _check(sub, f"{where}/{name}", root)
    elif key in _SUBSCHEMAS:
        if key == "items" and isinstance(value, list):
            raise UnsupportedSchema(f"{where}: a list of schemas is not supported: use prefixItems")
        if key.startswith("unevaluated") and value is not False:
            raise UnsupportedSchema(f"{where}: only false is supported")
        _check(value, where, root)
    elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if not isinstance(value, list) or not value:
            raise UnsupportedSchema(f"{where}: must be a non-empty list of schemas")
        for i, sub in enumerate(value):
            _check(sub, f"{where}/{i}", root)
        if key == "allOf" and len(value) > 1:
            raise UnsupportedSchema(f"{where}: allOf of more than one schema is not supported")
        if key == "oneOf":
            _check_disjoint(value, where, root)
    elif key == "$ref":
        if not isinstance(value, str) or not (value == "#" or value.startswith("#/")):
            raise UnsupportedSchema(f"{where}: only references within the schema (#/...) are supported")
        _resolve(value, root, where)
    elif key == "format":
        if value not in FORMATS:
            raise UnsupportedSchema(
                f"{where}: format {shown(value)} is not supported (supported: {', '.join(sorted(FORMATS))})"
            )
        if "minLength" in node or "maxLength" in node:
            raise UnsupportedSchema(f"{where}: format with minLength or maxLength is not supported")
    elif key == "uniqueItems" and value is not False:
        raise UnsupportedSchema(
            f"{where}: uniqueItems is not supported (the grammar engine cannot enforce it)"
        )
    elif key == "multipleOf" and _types(node, root) != {"integer"}:
        raise UnsupportedSchema(f"{where}: multipleOf is supported for integers only")
    elif key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
        raise UnsupportedSchema(f"{where}: must be a number (draft 4's boolean form is not supported)")


def _resolve(ref: str, root: dict[str, Any], where: str) -> Any:
    node: Any = root
    for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise UnsupportedSchema(f"{where}: {ref} points at nothing in the schema")
        node = node[part]
    return node


def _types(node: Any, root: dict[str, Any], depth: int = 0) -> set[str] | None:
    """The JSON types a schema admits, where that is plain to see (None: could be any)."""
    if depth > 16 or not isinstance(node, dict):
        return None
    if "$ref" in node and isinstance(node["$ref"], str):
        try:
            return _types(_resolve(node["$ref"], root, ""), root, depth + 1)
        except UnsupportedSchema:
            return None
    if "const" in node:
        return {_type_of(node["const"])}
    if isinstance(node.get("enum"), list) and node["enum"]:
        return {_type_of(v) for v in node["enum"]}
    kinds = node.get("type")
    if isinstance(kinds, str):
        return {kinds}
    if isinstance(kinds, list):
        return set(kinds)
    return None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "?")


def _values(node: Any, root: dict[str, Any]) -> list[Any] | None:
    """The values a schema admits when it lists them (const, enum)."""
    if isinstance(node, dict) and "$ref" in node and isinstance(node["$ref"], str):
        try:
            node = _resolve(node["$ref"], root, "")
        except UnsupportedSchema:
            return None
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else None


def _disjoint(a: Any, b: Any, root: dict[str, Any]) -> bool:
    """Whether no value can match both schemas: their types differ, their listed values differ,
    or, objects both, a property both require takes different listed values (a discriminator)."""
    ta, tb = _types(a, root), _types(b, root)
    if ta is not None and tb is not None:
        wa = ta | ({"integer"} if "number" in ta else set())
        wb = tb | ({"integer"} if "number" in tb else set())
        if not (wa & wb):
            return True
    va, vb = _values(a, root), _values(b, root)
    if va is not None and vb is not None and not any(x == y for x in va for y in vb):
        return True
    a, b = (_resolve(s["$ref"], root, "") if isinstance(s, dict) and "$ref" in s else s for s in (a, b))
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    both = set(a.get("required", ())) & set(b.get("required", ()))
    pa, pb = a.get("properties", {}), b.get("properties", {})
    for name in both:
        if isinstance(pa, dict) and isinstance(pb, dict) and name in pa and name in pb:
            xa, xb = _values(pa[name], root), _values(pb[name], root)
            if xa is not None and xb is not None and not any(x == y for x in xa for y in xb):
                return True
    return False


def _check_disjoint(branches: list[Any], where: str, root: dict[str, Any]) -> None:
    """xgrammar enforces oneOf as anyOf: exact only where no value can match two branches."""
    for i in range(len(branches)):
        for j in range(i + 1, len(branches)):
            if not _disjoint(branches[i], branches[j], root):
                raise UnsupportedSchema(
                    f"{where}: branches {i} and {j} may both match a value, and the grammar engine "
                    "enforces oneOf as anyOf: use anyOf, or make the branches differ in type or in a "
                    "required property's const"
                )


# ---- the rule ----------------------------------------------------------------------------------


def _text(name: str, value: Any, max_chars: int = MAX_CONSTRAINT_CHARS) -> str:
    if not isinstance(value, str):
        raise RuleError(f"{name}: must be a string, got {shown(value)}")
    if not value:
        raise RuleError(f"{name}: must not be empty")
    if len(value) > max_chars:
        raise RuleError(f"{name}: has {len(value)} characters, more than {max_chars}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RuleError(f"{name}: is not valid UTF-8 (a lone surrogate at character {exc.start})") from None
    return value


def schema_text(schema: Any) -> str:
    """A schema (an object, or its JSON text) as compact JSON text, checked (`check_json_schema`).
    Key order is kept: it is the order in which the output writes properties."""
    if isinstance(schema, str):
        _text("json", schema)
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise RuleError(f"json: is not valid JSON ({exc})") from None
    elif isinstance(schema, bool) or not isinstance(schema, dict):
        raise RuleError(f"json: must be a JSON schema (an object, or its JSON text), got {shown(schema)}")
    try:
        check_json_schema(schema)
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except UnsupportedSchema as exc:
        raise RuleError(f"json: {exc}") from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise RuleError(f"json: is not a JSON schema ({exc})") from None
    return _text("json", text)


@dataclass(frozen=True)
class StructuredOutputsRule(Rule):
    """One constraint: an object with exactly one of `json` (a schema object or its JSON text),
    `json_object` (true), `regex`, `choice` (a list of strings), `grammar` (EBNF), and optionally
    `disable_any_whitespace`; or a `StructuredOutputs` already checked."""

    def check(self, value: Any) -> StructuredOutputs:
        if isinstance(value, StructuredOutputs):
            value = value.as_dict()
        if not isinstance(value, Mapping):
            raise RuleError(f"must be an object with one of {', '.join(KINDS)}, got {shown(value)}")
        unknown = [k for k in value if k not in KINDS and k not in OPTIONS]
        if unknown:
            raise RuleError(f"{shown(unknown[0])} is not supported (give one of {', '.join(KINDS)})")
        given = [k for k in KINDS if value.get(k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise RuleError(f"must give exactly one of {', '.join(KINDS)}, got {what}")
        kind = given[0]
        whitespace = value.get("disable_any_whitespace")
        if whitespace is not None and not isinstance(whitespace, bool):
            raise RuleError(f"disable_any_whitespace: must be true or false, got {shown(whitespace)}")
        raw = value[kind]
        checked: str | tuple[str, ...] | None
        if kind == "json":
            checked = schema_text(raw)
        elif kind == "json_object":
            if raw is not True:
                raise RuleError(f"json_object: must be true, got {shown(raw)}")
            checked = None
        elif kind == "choice":
            checked = _choices(raw)
        else:
            checked = _text(kind, raw)
        return StructuredOutputs(kind, checked, bool(whitespace))

    def from_text(self, text: Any) -> Any:
        """The command line's word: the constraint as JSON (`'{"regex": "[0-9]+"}'`)."""
        if not isinstance(text, str):
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text

    def describe(self) -> str:
        return (
            "an object with one of `json` (a JSON schema), `json_object` (true), `regex`, `choice` (a list "
            "of strings), `grammar` (EBNF); optionally `disable_any_whitespace`"
        )

    def json_schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "json": {"anyOf": [{"type": "object"}, {"type": "string"}]},
                "json_object": {"type": "boolean"},
                "regex": {"type": "string"},
                "choice": {"type": "array", "items": {"type": "string"}},
                "grammar": {"type": "string"},
                "disable_any_whitespace": {"type": "boolean"},
            },
        }


def _choices(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise RuleError(f"choice: must be a non-empty list of strings, got {shown(value)}")
    if len(value) > MAX_CHOICES:
        raise RuleError(f"choice: has {len(value)} strings; at most {MAX_CHOICES} are allowed")
    return tuple(_text("choice", s, MAX_CHOICE_CHARS) for s in value)
