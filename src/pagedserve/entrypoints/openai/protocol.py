"""The OpenAI API's request and response bodies (the subset pagedserve serves), as pydantic models.

Requests accept OpenAI's fields and vLLM's extras (`top_k`, `min_tokens`, `ignore_eos`, `priority`,
`stop_token_ids`); unknown fields are ignored, as OpenAI's SDKs send some this server has no use
for. The fields a generation request has at every door (`temperature`, `max_tokens`, `prompt`, ...)
are parsed as any JSON here and checked by the one validation (pagedserve.common.validation), so
that their verdict is the same as over gRPC, on the command line and in `LLM`; their OpenAPI
schema is their rule's. A field only this API has, whose value pagedserve cannot honour
(penalties, echo, top logprobs), is refused by its validator, so the 400 names it as `param`.

Structured outputs arrive in any of OpenAI's and vLLM's forms: `response_format` (`json_object`,
`json_schema`), vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and its
newer `structured_outputs` object; each becomes the one validation's `structured_outputs`, and a
refusal names the field the body used. Chat's `tools` and `tool_choice` are read by
entrypoints/openai/tool_calls.py.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, WithJsonSchema, field_validator

from pagedserve.common.rules import Text
from pagedserve.common.structured_outputs import OPTIONS
from pagedserve.common.validation import FIELDS, InvalidRequest


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def checked(name: str) -> Any:
    """The type of a body field the one validation checks: any JSON (null: the field's default),
    described in the OpenAPI schema by the field's rule."""
    schema = FIELDS[name].rule.json_schema()
    return Annotated[Any, WithJsonSchema({"anyOf": [schema, {"type": "null"}]})]


# ---- errors -------------------------------------------------------------------------------------


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---- requests -----------------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise InvalidRequest("structured_outputs", "json_schema.schema must be given")
            return {"json": self.json_schema.schema_}
        return None


# The body's fields that carry a constraint, and the form each gives to `structured_outputs`.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class SamplingRequest(OpenAIModel):
    """The fields completions and chat completions share."""

    model: str | None = None
    temperature: checked("temperature") = None
    top_p: checked("top_p") = None
    n: checked("n") = None
    seed: checked("seed") = None
    stop: checked("stop") = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: checked("top_k") = None
    min_tokens: checked("min_tokens") = None
    ignore_eos: checked("ignore_eos") = None
    priority: checked("priority") = None
    stop_token_ids: checked("stop_token_ids") = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* extras.
    response_format: ResponseFormat | None = None
    structured_outputs: checked("structured_outputs") = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported (give 0 or leave it out)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def request_values(self) -> dict[str, Any]:
        """The body's fields the one validation checks, by their names there (all of them that this
        body has under the same name; see the subclasses for the others). Raises InvalidRequest
        when the body gives more than one constraint."""
        values = {name: getattr(self, name) for name in FIELDS if name in type(self).model_fields}
        values["structured_outputs"] = self.constraint()
        return values

    def constraint_sources(self) -> dict[str, Any]:
        """The constraint each of the body's fields gives, by the field's name (those it gives)."""
        sources: dict[str, Any] = {}
        if self.response_format is not None:
            try:
                constraint = self.response_format.constraint()
            except InvalidRequest as exc:
                raise InvalidRequest("response_format", exc.reason) from None
            if constraint is not None:
                sources["response_format"] = constraint
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                sources[name] = {kind: getattr(self, name)}
        options = self.constraint_options()
        # Options alone with nothing to apply them to are refused as a constraint of no kind.
        if self.structured_outputs is not None and not (options and (sources or self.tools_constrain)):
            sources["structured_outputs"] = self.structured_outputs
        if options:  # the options alone apply to the constraint another field gives
            for name, constraint in sources.items():
                if name != "structured_outputs" and isinstance(constraint, dict):
                    sources[name] = constraint | options
        return sources

    @property
    def tools_constrain(self) -> bool:
        """Whether chat's tools give the constraint (tool_choice "required" or a named function)."""
        return False

    def constraint_options(self) -> dict[str, Any]:
        """`structured_outputs` when it holds only options (`disable_any_whitespace`): they apply
        to the constraint given by response_format, guided_* or chat's tools."""
        extra = self.structured_outputs
        if isinstance(extra, dict) and extra and set(extra) <= set(OPTIONS):
            return dict(extra)
        return {}

    def constraint(self) -> Any:
        """The one constraint the body gives (None: none); `disable_any_whitespace` alone in
        `structured_outputs` applies to a constraint given by another field."""
        sources = self.constraint_sources()
        if len(sources) > 1:
            first, second = list(sources)[:2]
            raise InvalidRequest(second, f"gives a constraint, and so does {first}: give one")
        return next(iter(sources.values()), None)

    def aliases(self) -> dict[str, str]:
        """The body's name of each validated field it gives under another name (for `param`)."""
        try:
            sources = list(self.constraint_sources())
        except InvalidRequest:
            return {"structured_outputs": "response_format"}
        return {"structured_outputs": sources[0]} if sources else {}


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. One prompt per request: text, or token ids."""

    prompt: checked("prompt")
    max_tokens: checked("max_tokens") = 16
    logprobs: checked("logprobs") = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: StrictBool = False  # vLLM's extra: each choice (and chunk) carries its token ids

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """OpenAI's batch forms with one prompt (`["text"]`, `[[ids]]`) are that prompt."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer names the call

    @field_validator("role", "name")
    @classmethod
    def _utf8(cls, value: str | None) -> str | None:
        return value if value is None else Text().check(value)

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates take it: text parts joined by newlines."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. The prompt is the messages rendered by the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: checked("max_tokens") = None
    max_completion_tokens: checked("max_tokens") = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("only the sampled token's logprob is available: give 0 or leave it out")
        return value

    @property
    def tools_constrain(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's form)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools]

    def request_values(self) -> dict[str, Any]:
        values = super().request_values()
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            values["max_tokens"] = self.max_completion_tokens
        values["logprobs"] = 0 if self.logprobs else None
        return values

    def aliases(self) -> dict[str, str]:
        names = {"prompt": "messages", **super().aliases()}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names


# ---- responses ----------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)  # with return_token_ids


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProb(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatLogProbs(OpenAIModel):
    content: list[ChatLogProb] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda v: not v)


class ChatChoice(OpenAIModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaFunctionCall(OpenAIModel):
    name: str | None = Field(None, exclude_if=lambda v: v is None)
    arguments: str = ""


class DeltaToolCall(OpenAIModel):
    """A piece of a streamed call: the first of each call has its id, type and name."""

    index: int
    id: str | None = Field(None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda v: v is None)
    function: DeltaFunctionCall


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=lambda v: not v)


class ChatStreamChoice(OpenAIModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = Field(None, exclude_if=lambda v: v is None)  # the include_usage chunk


class CompletionChunk(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(None, exclude_if=lambda v: v is None)  # the include_usage chunk


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
