"""What only the scheduler can check about a request: how it fits the model its executors serve.

Everything else (types, ranges, lengths, empty prompts) is the one validation every door runs
(`pagedserve.common.validation`); what is here needs the model's limits, which an executor reports
on attach: the prompt's token ids within the vocabulary, prompt + max_tokens within max_model_len,
stop token ids within the vocabulary. Every door reaches it (gRPC through the service, `LLM` and
the in-process bench directly) and it refuses with the same `InvalidRequest`, naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.common.rules import SHOWN_VALUES
from pagedserve.common.validation import InvalidRequest, RequestParams
from pagedserve.scheduler.completion import StopConditions
from pagedserve.scheduler.replica import ExecutorInfo
from pagedserve.scheduler.request import SamplingOptions


def check_prompt(ids: Sequence[int], info: ExecutorInfo) -> None:
    """Checks the prompt's token ids (the request's own, or its text tokenized) against the model."""
    if not ids:
        raise InvalidRequest("prompt", "the text tokenizes to no token")
    if max(ids) >= info.vocab_size:  # a tokenizer larger than the model, too
        bad = [i for i in ids if i >= info.vocab_size][:SHOWN_VALUES]
        raise InvalidRequest("prompt", f"token ids {bad} are outside the vocabulary (size {info.vocab_size})")
    if len(ids) > info.max_model_len:
        raise InvalidRequest(
            "prompt", f"has {len(ids)} tokens, more than max_model_len ({info.max_model_len})"
        )


def sampling_options(params: RequestParams) -> SamplingOptions:
    """The executor's sampling settings, the server's defaults for what the request left unset."""
    return SamplingOptions(
        temperature=1.0 if params.temperature is None else params.temperature,
        top_p=1.0 if params.top_p is None else params.top_p,
        top_k=params.top_k or 0,
        seed=params.seed,
        return_logprobs=params.logprobs is not None,
    )


def stop_conditions(params: RequestParams, num_prompt_tokens: int, info: ExecutorInfo) -> StopConditions:
    """What ends the request; max_tokens unset is the room max_model_len leaves after the prompt."""
    room = info.max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidRequest(
            "prompt",
            f"has {num_prompt_tokens} tokens; max_model_len is {info.max_model_len}, which leaves no "
            "room to generate",
        )
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise InvalidRequest(
            "max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
            f"({info.max_model_len})",
        )
    if params.min_tokens > max_tokens:
        raise InvalidRequest(
            "min_tokens",
            f"({params.min_tokens}) exceeds max_tokens ({max_tokens}, the room max_model_len "
            f"{info.max_model_len} leaves after the prompt)",
        )
    stop_ids = set(params.stop_token_ids)
    if stop_ids and max(stop_ids) >= info.vocab_size:
        bad = sorted(i for i in stop_ids if i >= info.vocab_size)[:SHOWN_VALUES]
        raise InvalidRequest("stop_token_ids", f"{bad} are outside the vocabulary (size {info.vocab_size})")
    if not params.ignore_eos:
        stop_ids.update(info.eos_token_ids)
    return StopConditions(
        max_tokens=max_tokens,
        min_tokens=params.min_tokens,
        stop_strings=params.stop,
        stop_token_ids=frozenset(stop_ids),
    )
