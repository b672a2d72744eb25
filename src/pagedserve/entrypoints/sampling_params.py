"""`SamplingParams`: vLLM's names and defaults for how one prompt is completed.

It maps onto the public API's `GenerateRequest` (`to_request`), so the offline API and the gRPC
service derive the engine's sampling and stop settings through the same code
(`pagedserve.scheduler.service.sampling_options` / `stop_conditions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.protos import generation_pb2

_MAX_SEED = (1 << 64) - 1  # GenerateRequest.sampling.seed is a uint64


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop; invalid values raise ValueError naming the field.

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
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if self.n != 1:
            raise ValueError(f"n must be 1 (one completion per prompt is supported), got {self.n!r}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise bad("temperature", "a finite number >= 0")
        if self.temperature < 0:
            raise bad("temperature", "a finite number >= 0")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer >= 0 (0 or -1 disables it)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise bad("seed", "None or an integer in [0, 2**64)")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "None or an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "a non-empty string or a list of them")
        object.__setattr__(self, "_stop", tuple(stop))
        ids = self.stop_token_ids or []
        if not all(is_int(i) and i >= 0 for i in ids):
            raise bad("stop_token_ids", "a list of token ids (integers >= 0)")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs not in (0, 1)):
            raise bad("logprobs", "None, 0 or 1 (only the sampled token's logprob is returned)")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple (one string becomes one element)."""
        return self._stop

    def to_request(
        self, prompt_token_ids: list[int], request_id: str = "", seed: int | None = None
    ) -> generation_pb2.GenerateRequest:
        """The public API's request for these settings; `seed` is used when `self.seed` is None."""
        seed = self.seed if self.seed is not None else seed
        return generation_pb2.GenerateRequest(
            request_id=request_id,
            token_ids=generation_pb2.TokenIds(ids=prompt_token_ids),
            sampling=generation_pb2.SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=max(self.top_k, 0),
                seed=seed,
            ),
            stopping=generation_pb2.StoppingCriteria(
                max_tokens=self.max_tokens,
                stop=self._stop,
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
            ),
            return_logprobs=self.logprobs is not None,
        )
