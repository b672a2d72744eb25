"""Token sampling for a batch of rows, each with its own parameters.

Greedy rows (temperature 0) take the argmax. Other rows are scaled by temperature, masked by top-k
and top-p (one sort serves both), then sampled with the exponential race: argmax(p / E), E ~ Exp(1)
i.i.d., picks token i with probability p_i, and unlike torch.multinomial needs only one noise
vector per row that we can draw from a generator of our choosing.

A seeded row draws its noise from a generator seeded with mix(seed, position of the sampled
token): its tokens depend only on its own logits, seed and position, never on which other rows share
the batch, or on whether the request was pre-empted and re-created in between.

Structured outputs: rows with a token bitmask (the scheduler's packed next-token mask, see
`TokenMasks`) have every token it forbids set to -inf first, so whatever the parameters the sampled
token is one the grammar allows; logprobs stay those of the model's own distribution.

Nothing here waits for the device: per-row parameters travel through pinned memory
(`executor.transfer.to_device`), so the executor can queue the next step behind this one. An
all-greedy batch without logprobs costs a single argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.executor.transfer import to_device
from pagedserve.kernels import layers

_M64 = (1 << 64) - 1
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Raises ValueError on values that make no sense."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None
    return_logprobs: bool = False
    return_prompt_logprobs: bool = False  # the runner reports log p(prompt token | tokens before it)
    min_tokens: int = 0  # until this many tokens are generated, stop_token_ids are never sampled
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= _M64:
            raise ValueError(f"seed must be a uint64, got {self.seed}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    def banned_ids(self, num_generated: int) -> tuple[int, ...]:
        """Token ids this request may not sample after `num_generated` generated tokens."""
        return self.stop_token_ids if num_generated < self.min_tokens else ()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [num_rows] int64
    logprobs: torch.Tensor | None  # [num_rows] float32, None when no row asked


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(seed: int, position: int) -> int:
    """A well-spread 63-bit generator seed for (request seed, token position)."""
    return _splitmix64(seed ^ _splitmix64(position)) >> 1


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets to -inf every logit outside each row's top-k and top-p nucleus (one sort for both).

    Args:
        logits: [rows, vocab] float32 (already temperature-scaled).
        top_k: [rows] int64, vocab size where off.
        top_p: [rows] float32, 1 where off.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass before it is below top_p: the top token always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits.masked_fill_(mass_before > top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def exponential_noise(probs: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]):
    """Exp(1) noise per row: one batched draw for the unseeded rows, a seeded generator per seeded row."""
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    if not seeded:
        return torch.empty_like(probs).exponential_()
    noise = torch.empty_like(probs)
    if len(seeded) < len(params):
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        rows = to_device(unseeded, torch.int64, probs.device)
        noise[rows] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_()
    for i in seeded:
        generator = torch.Generator(device=probs.device).manual_seed(mix_seed(params[i].seed, positions[i]))
        noise[i].exponential_(generator=generator)
    return noise


@dataclass(frozen=True)
class TokenMasks:
    """Packed next-token masks for some rows of a batch: `bitmask` int32 [len(rows), words] on the
    device, bit t % 32 of word t / 32 set where token t is allowed; `rows` int64, their batch rows."""

    rows: torch.Tensor
    bitmask: torch.Tensor


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """`logits` with -inf where the masks forbid (a new tensor; the rows without one unchanged).
    The bits are unpacked on the device: one shift-and-compare over [rows, words, 32]."""
    vocab = logits.shape[1]
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((masks.bitmask[:, :, None] >> shifts) & 1).bool().reshape(len(masks.bitmask), -1)
    allowed = allowed[:, :vocab]
    if allowed.shape[1] < vocab:  # a mask narrower than the logits forbids the rest
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits = logits.clone()
    logits[masks.rows] = logits[masks.rows].masked_fill(~allowed, float("-inf"))
    return logits


def ban_tokens(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    if not rows:
        return logits
    cols = [t for ids in banned for t in ids]
    logits = logits.clone()
    device = logits.device
    logits[to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    banned: Sequence[Sequence[int]] | None = None,
    masks: TokenMasks | None = None,
) -> SamplerOutput:
    """Samples one token per row, without waiting for the device (the result stays on it).

    Args:
        logits: [rows, vocab] float32, raw model output.
        params: one per row.
        positions: one per row, the position the sampled token will take in its sequence (seeds
            are mixed with it so every position draws fresh, reproducible noise).
        banned: per row, token ids that must not be sampled (min_tokens). Logprobs are still those
            of the raw distribution.
        masks: structured outputs: the rows that may sample only what their bitmask allows.
    """
    raw = logits
    if masks is not None:
        logits = apply_token_masks(logits, masks)
    if banned is not None:
        logits = ban_tokens(logits, banned)
    token_ids = layers.argmax(logits)  # all that an all-greedy batch needs
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        _sample_rows(logits, token_ids, params, positions, sampled_rows)
    logprobs = None
    if any(p.return_logprobs for p in params):
        logprobs = raw.log_softmax(dim=-1).gather(1, token_ids[:, None]).squeeze(1)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[row, target_ids[row]] per row: [rows] float32 (rows are prompt positions,
    targets the prompt tokens that follow them)."""
    return logits.float().log_softmax(dim=-1).gather(1, target_ids[:, None]).squeeze(1)


def _sample_rows(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    rows: list[int],
) -> None:
    """Overwrites token_ids[rows] with tokens sampled by temperature, top-k/top-p and the race."""
    device, vocab = logits.device, logits.shape[1]
    every_row = len(rows) == len(params)
    sub = params if every_row else [params[i] for i in rows]
    rows_t = None if every_row else to_device(rows, torch.int64, device)
    temperature = to_device([p.temperature for p in sub], torch.float32, device)
    scaled = (logits if rows_t is None else logits[rows_t]) / temperature[:, None]
    if any(0 < p.top_k < vocab or p.top_p < 1 for p in sub):
        top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in sub], torch.int64, device)
        top_p = to_device([p.top_p for p in sub], torch.float32, device)
        scaled = mask_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = exponential_noise(probs, sub, positions if every_row else [positions[i] for i in rows])
    choice = (probs / noise).argmax(dim=-1)
    if rows_t is None:
        token_ids.copy_(choice)
    else:
        token_ids[rows_t] = choice
