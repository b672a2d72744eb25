"""`SamplingParams`: vLLM's names and defaults for how one prompt is completed.

Its values are checked by the one validation every door runs (`pagedserve.common.validation`), so
a value the gRPC service or the gateway would refuse is refused here, as a ValueError naming the
field; `LLM` then checks each prompt with them the same way, and against the model as the
scheduler does (`pagedserve.scheduler.admission`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.validation import check_fields, to_proto, validate_request
from pagedserve.protos import generation_pb2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of `json` (a JSON schema, as a dict
    or its JSON text), `regex`, `choice` (a list of strings), `grammar` (EBNF) or `json_object`
    (True: any JSON object). `disable_any_whitespace`: JSON with no whitespace beyond ", " and ": ".
    Checked by the one validation when the SamplingParams holding it is made; a regex or grammar
    that does not compile is refused by `LLM.generate` before anything runs."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The constraint as the one validation takes it (unset kinds left out)."""
        out = {k: v for k, v in vars(self).items() if v is not None and k != "disable_any_whitespace"}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = self.disable_any_whitespace
        return out


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop; invalid values raise ValueError naming the field (None, for
    any of them, means the default: for max_tokens, up to max_model_len).

    Attributes:
        n: completions per prompt (only 1 is supported).
        temperature: 0 is greedy.
        top_p: nucleus sampling mass, in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 (vLLM's "off") disables it.
        seed: a per-request seed: the same seed and prompt give the same tokens.
        max_tokens: the most tokens to generate (vLLM's default 16); None = up to max_model_len.
        min_tokens: tokens generated before EOS or a stop token may end the completion.
        stop: a string or strings that end the completion (not included in the text).
        stop_token_ids: token ids that end the completion, besides EOS.
        ignore_eos: keep generating after EOS.
        logprobs: 0 or 1 returns the sampled token's logprob per token (no top-k alternatives).
        structured_outputs: constrains the output (`StructuredOutputsParams`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _checked: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_checked", check_fields(self.request_values()))

    def request_values(self) -> dict[str, Any]:
        """The request fields these settings give, as the one validation names them."""
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
            "structured_outputs": (
                self.structured_outputs.as_dict()
                if isinstance(self.structured_outputs, StructuredOutputsParams)
                else self.structured_outputs
            ),
        }

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple (one string becomes one element)."""
        return self._checked["stop"]

    def to_request(
        self, prompt_token_ids: list[int], request_id: str = "", seed: int | None = None
    ) -> generation_pb2.GenerateRequest:
        """The public API's request for these settings; `seed` is used when `self.seed` is None."""
        values = self.request_values()
        values.update(
            prompt=prompt_token_ids,
            request_id=request_id,
            seed=values["seed"] if self.seed is not None else seed,
        )
        return to_proto(validate_request(values))
