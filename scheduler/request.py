"""One generation request as the scheduler sees it: token ids and progress counters, no policy."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:
    from pagedserve.scheduler.structured import RequestGrammar

SeqId = NewType("SeqId", int)


class RequestStatus(enum.Enum):
    """Where a request is. RUNNING and LOADING requests hold GPU blocks; SWAPPED ones hold CPU
    blocks. A LOADING request is admitted on a prefix the CPU tier holds: the plan that admitted it
    loads those blocks, and its tokens are scheduled from the next plan on (scheduler.core)."""

    WAITING = enum.auto()
    LOADING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling parameters, passed through to the executor unchanged (temperature 0 = greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    return_logprobs: bool = False


@dataclass(eq=False)
class Request:
    """A request's tokens and progress.

    The scheduler plans one step ahead of the outputs it has seen, so a request can have sampled
    tokens whose values are not known yet: ``num_pending_outputs`` counts them (one per plan in
    flight that samples it, so 0 or 1 between steps, briefly 2 right after ``schedule()`` while the
    previous step's output is outstanding). The executor feeds those tokens to later steps itself.

    Attributes:
        seq_id: unique for the scheduler's lifetime.
        prompt_token_ids: the prompt; never empty.
        max_tokens: the most new tokens to generate (the engine caps it to max_model_len - prompt).
        sampling: passed to the executor.
        priority: lower runs sooner; ties are broken by arrival.
        output_token_ids: sampled tokens whose values are known.
        num_pending_outputs: sampled tokens whose values have not arrived yet.
        num_computed_tokens: tokens whose KV is (or will be, once in-flight plans run) in its blocks.
        num_cached_prompt_tokens: prompt tokens taken from the prefix cache at first admission
            (both tiers).
        num_cpu_cached_prompt_tokens: those of them loaded from the CPU tier.
        num_preemptions: how many times it was pre-empted.
        status: see RequestStatus.
        arrival: arrival order, set by ``Scheduler.add_request``; breaks priority ties.
        arrival_time: time.monotonic() when the request was created (queue time starts here).
        first_scheduled_time: time.monotonic() when a step first scheduled it (queue time ends).
        grammar: structured outputs: its matcher, which has accepted exactly `output_token_ids`
            (None: unconstrained). A constrained request samples only with no output pending
            (see scheduler/core.py), so that its mask is computed from every token before it.
        num_draft_tokens: speculative decoding: proposed tokens of the step in flight, counted in
            `num_computed_tokens` until its output says how many were accepted (0: none).
        num_draft_tokens_total / num_accepted_tokens_total: its proposals and the accepted ones.
    """

    seq_id: SeqId
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_pending_outputs: int = 0
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_cpu_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    arrival: int = field(default=-1, repr=False)
    arrival_time: float = field(default_factory=time.monotonic, repr=False)
    first_scheduled_time: float | None = field(default=None, repr=False)
    grammar: RequestGrammar | None = field(default=None, repr=False)
    num_draft_tokens: int = 0
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known here: the prompt and the sampled tokens that have arrived."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """All tokens, counting sampled ones whose values are still in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_outputs

    @property
    def num_sampled_tokens(self) -> int:
        """Tokens sampled so far, arrived or not; never exceeds ``max_tokens``."""
        return len(self.output_token_ids) + self.num_pending_outputs

    @property
    def all_token_ids(self) -> list[int]:
        """Every known token id: the prompt, then the outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def sort_key(self) -> tuple[int, int]:
        """Queue order: priority, then arrival."""
        return (self.priority, self.arrival)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known token ids in positions [start, end), without building the whole token list."""
        num_prompt = len(self.prompt_token_ids)
        if end > self.num_known_tokens:
            raise IndexError(f"tokens up to {end} requested, {self.num_known_tokens} known")
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
