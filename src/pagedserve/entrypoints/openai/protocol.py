"""The OpenAI API's request and response bodies (the subset pagedserve serves), as pydantic models.

Requests accept OpenAI's fields and vLLM's extras (`top_k`, `min_tokens`, `ignore_eos`, `priority`,
`stop_token_ids`); unknown fields are ignored, as OpenAI's SDKs send some this server has no use
for. The fields a generation request has at every door (`temperature`, `max_tokens`, `prompt`, ...)
are parsed as any JSON here and checked by the one validation (pagedserve.common.validation), so
that their verdict is the same as over gRPC, on the command line and in `LLM`; their OpenAPI
schema is their rule's. A field only this API has, whose value pagedserve cannot honour
(penalties, echo, tools, top logprobs), is refused by its validator, so the 400 names it as `param`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, WithJsonSchema, field_validator

from pagedserve.common.rules import Text
from pagedserve.common.validation import FIELDS


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
        body has under the same name; see the subclasses for the others)."""
        return {name: getattr(self, name) for name in FIELDS if name in type(self).model_fields}

    def aliases(self) -> dict[str, str]:
        """The body's name of each validated field it gives under another name (for `param`)."""
        return {}


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
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. The prompt is the messages rendered by the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: checked("max_tokens") = None
    max_completion_tokens: checked("max_tokens") = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("only the sampled token's logprob is available: give 0 or leave it out")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tools are not supported")
        return value

    def request_values(self) -> dict[str, Any]:
        values = super().request_values()
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            values["max_tokens"] = self.max_completion_tokens
        values["logprobs"] = 0 if self.logprobs else None
        return values

    def aliases(self) -> dict[str, str]:
        names = {"prompt": "messages"}
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


class ChatMessageOut(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None


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
