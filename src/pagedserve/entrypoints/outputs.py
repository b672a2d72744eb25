"""What `LLM.generate` returns: vLLM's `RequestOutput` / `CompletionOutput` shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """The log-probability of one sampled token (`rank` is not computed: None)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: the completion's index among the prompt's (always 0: n is 1).
        text: the generated text (a stop string that ended it is not included).
        token_ids: the generated token ids (an EOS or stop token that ended it is included).
        cumulative_logprob: the sum of `logprobs`, when they were asked for.
        logprobs: per generated token, {token id: Logprob}, when `SamplingParams.logprobs` is set.
        finish_reason: "stop" (EOS, a stop token or string) or "length" (max_tokens or max_model_len).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt, in the order the prompts were given.

    Attributes:
        request_id: unique within the `LLM` object.
        prompt: the prompt's text (None for a prompt given as token ids).
        prompt_token_ids: the prompt as the model saw it.
        outputs: its completions (one).
        finished: True once the completion has ended.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
