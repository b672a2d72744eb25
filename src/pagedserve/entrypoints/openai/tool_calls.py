"""Chat `tools`: what each `tool_choice` asks of the output, and the output read back as tool calls.

* a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained to
  that function's `parameters` schema; the whole output is the call's `arguments` (vLLM's way);
* `"required"`: the output is constrained to a JSON array of one or more `{"name", "parameters"}`
  objects, each naming a declared function with arguments valid for it (`parallel_tool_calls`
  false: exactly one);
* `"auto"`: the output is free; the tools go into the chat template, and calls the model writes in
  the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5/3,
  Hermes, and most templates that declare tools), are parsed out of it. A template that does not
  mention `tools` never shows them to the model, so `auto` is refused there;
* `"none"`: no constraint and no parsing.

The same `ToolCallParser` serves both forms of a response: a streamed one feeds it each text delta
and sends what it returns at once (arguments of a named call as they come, a required or Hermes
call whole once its JSON is complete), a plain one feeds it everything and keeps the sum.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedserve.common.rules import RuleError
from pagedserve.common.structured_outputs import check_json_schema

ToolMode = Literal["none", "auto", "required", "named"]
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


class ToolChoiceError(ValueError):
    """A tools request that cannot be served; `param` is the body's field to name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.reason = param, message


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: the mode, the functions by name (their parameters
    schemas), and the constraint the output gets (`structured_outputs`' form; None: free)."""

    mode: ToolMode
    functions: dict[str, dict[str, Any]] = field(default_factory=dict)
    constraint: dict[str, Any] | None = None


def _function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params is not None else {"type": "object", "properties": {}}


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of a schema whose `#/...` references point into it where it lives at `base`."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = base + value[1:]
            else:
                out[key] = _rebase_refs(value, base)
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def required_calls_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each `{"name": <a declared name>, "parameters": <valid arguments>}`.
    Each function's schema sits under `$defs` so that its own references still resolve."""
    defs, branches = {}, []
    for i, (name, params) in enumerate(functions.items()):
        key = f"tool_{i}"
        defs[key] = _rebase_refs(params, f"#/$defs/{key}")
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{key}"}},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    items = branches[0] if len(branches) == 1 else {"anyOf": branches}
    schema: dict[str, Any] = {"$defs": defs, "type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    template_declares_tools: bool,
) -> ToolPlan:
    """The request's `tools` and `tool_choice` as a ToolPlan; raises ToolChoiceError naming the
    body's field. OpenAI's default choice is "auto" with tools, "none" without."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolChoiceError("tool_choice", "needs tools")
        return ToolPlan("none")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in functions:
            raise ToolChoiceError(f"tools.{i}.function.name", f"{name!r} is declared twice")
        params = _function_parameters(tool)
        try:
            check_json_schema(params)
        except RuleError as exc:
            raise ToolChoiceError(f"tools.{i}.function.parameters", str(exc)) from None
        functions[name] = params
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolChoiceError(
                "tool_choice",
                'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
            )
        if name not in functions:
            raise ToolChoiceError("tool_choice", f"names {name!r}, which is not among the tools")
        return ToolPlan("named", {name: functions[name]}, {"json": functions[name]})
    if choice == "none":
        return ToolPlan("none", functions)
    if choice == "required":
        schema = required_calls_schema(functions, parallel_tool_calls is not False)
        return ToolPlan("required", functions, {"json": schema})
    if choice == "auto":
        if not template_declares_tools:
            raise ToolChoiceError(
                "tool_choice",
                '"auto" needs a chat template that declares tools (this model\'s does not mention '
                'them): give "required" or a named function, or a --chat-template that does',
            )
        return ToolPlan("auto", functions)
    raise ToolChoiceError(
        "tool_choice", f'must be "none", "auto", "required" or a named function, got {choice!r}'
    )


# ---- reading calls back ------------------------------------------------------------------------


@dataclass
class ToolCallDelta:
    """A piece of a call, as OpenAI streams it: the first piece of a call has its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Parsed:
    """What a feed gives back: text for `content`, and pieces of calls."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def _arguments_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolCallParser:
    """Reads a completion's text, delta by delta, as content and tool calls (see the module doc)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._buffer = ""  # text not yet given back (required: the array so far; auto: held back)
        self._scan = 0  # required: how far the array has been scanned
        self._depth = 0
        self._in_string = self._escaped = False
        self._item_start: int | None = None

    @property
    def active(self) -> bool:
        """Whether the output is read for calls at all."""
        return self.plan.mode != "none"

    def feed(self, text: str) -> Parsed:
        mode = self.plan.mode
        if mode == "none" or not text:
            return Parsed(content=text if mode == "none" else "")
        if mode == "named":
            return self._named(text)
        self._buffer += text
        return self._required() if mode == "required" else self._hermes(final=False)

    def finish(self) -> Parsed:
        """The end of the text: what was held back (an incomplete call stays content)."""
        if self.plan.mode == "auto":
            return self._hermes(final=True)
        if self.plan.mode == "required" and not self.num_calls and self._buffer.strip():
            rest, self._buffer = self._buffer, ""
            return Parsed(content=rest)
        return Parsed()

    def _named(self, text: str) -> Parsed:
        (name,) = self.plan.functions
        if self.num_calls == 0:
            self.num_calls = 1
            return Parsed(calls=[ToolCallDelta(0, new_call_id(), name, text)])
        return Parsed(calls=[ToolCallDelta(0, arguments=text)])

    def _required(self) -> Parsed:
        """Finds each element of the top-level array as it closes (a small JSON scanner)."""
        out = Parsed()
        buf = self._buffer
        for i in range(self._scan, len(buf)):
            ch = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2 and ch == "{":
                    self._item_start = i
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}" and self._item_start is not None:
                    call = self._call(buf[self._item_start : i + 1], "parameters")
                    if call is not None:
                        out.calls.append(call)
                    self._item_start = None
        self._scan = len(buf)
        return out

    def _call(self, text: str, arguments_key: str) -> ToolCallDelta | None:
        try:
            item = json.loads(text)
        except ValueError:
            return None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get(arguments_key, item.get("parameters", {}))
        call = ToolCallDelta(self.num_calls, new_call_id(), item["name"], _arguments_text(arguments))
        self.num_calls += 1
        return call

    def _hermes(self, final: bool) -> Parsed:
        """Content up to each `<tool_call>`, each complete call, and, unless final, the tail that
        may be the start of a tag held back."""
        out = Parsed()
        while True:
            buf = self._buffer
            start = buf.find(HERMES_START)
            if start < 0:
                keep = 0 if final else _partial_suffix(buf, HERMES_START)
                out.content += buf[: len(buf) - keep]
                self._buffer = buf[len(buf) - keep :]
                return out
            out.content += buf[:start]
            end = buf.find(HERMES_END, start)
            if end < 0 and not final:
                self._buffer = buf[start:]
                return out
            body = buf[start + len(HERMES_START) : end if end >= 0 else len(buf)]
            call = self._call(body.strip(), "arguments")
            if call is None:  # not a call after all: the model's text
                out.content += buf[start : end + len(HERMES_END) if end >= 0 else len(buf)]
            else:
                out.calls.append(call)
            self._buffer = buf[end + len(HERMES_END) :] if end >= 0 else ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def merge_calls(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Streamed pieces summed into whole calls, by index."""
    calls: dict[int, ToolCallDelta] = {}
    for piece in pieces:
        call = calls.setdefault(piece.index, ToolCallDelta(piece.index))
        call.id = call.id or piece.id
        call.name = call.name or piece.name
        call.arguments += piece.arguments
    return [calls[i] for i in sorted(calls)]


def template_declares_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` (a Jinja name, not a word in its text)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: an assistant's tool-call arguments as objects (they
    arrive as JSON text, and templates write them with `tojson`), as vLLM gives them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        call = dict(call)
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                pass
        call["function"] = function
        out.append(call)
    return {**message, "tool_calls": out}
