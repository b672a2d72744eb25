"""Chat templates: a conversation rendered to prompt text and token ids, for `LLM.chat` and the
gateway's /v1/chat/completions alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.common.rules import RuleError, Text


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template refused the conversation."""


def load_chat_template(source: str | Path | None) -> str | None:
    """`--chat-template`: a file's contents (a path that exists), else the template text itself."""
    if source is None:
        return None
    path = Path(source)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template text too long to be a file name
        pass
    if isinstance(source, Path) or "{" not in source:
        raise ChatTemplateError(f"chat template file {source} does not exist")
    return source


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """The prompt text of `conversation` with the generation prompt appended, and its token ids.
    `tools` (OpenAI's form) are given to the template, which declares them to the model as it
    was trained to see them (a template that does not mention them ignores them).

    The text is tokenized without adding special tokens: a template writes the BOS it wants itself
    (Llama-3's does), and adding another would give the model a prompt it was not trained on.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        raise ChatTemplateError(
            f"the tokenizer of {name} has no chat template; give one (LLM.chat(chat_template=...), "
            "or the gateway's --chat-template FILE)"
        )
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=True, tools=tools
        )
    except Exception as exc:  # jinja2 errors, raise_exception() in the template, bad message shapes
        raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from exc
    try:
        Text().check(text)  # as every door checks a prompt's text (a lone surrogate has no UTF-8 form)
    except RuleError as exc:
        raise ChatTemplateError(f"the messages' text {exc}") from None
    return text, list(tokenizer.encode(text, add_special_tokens=False))
