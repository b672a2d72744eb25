"""Speculative decoding's acceptance: which proposed tokens a verification step keeps.

A speculating sequence computes its last sampled token and its d proposals in one forward, so the
step has logits at d + 1 positions: row j predicts the token after proposal j (row 0: after the
last sampled token). Acceptance runs on the device, for every speculating sequence at once, and
returns per sequence the accepted proposals followed by one more token (the correction at the first
rejection, or the bonus after all d), their count and their logprobs.

Two rules, both of which make the emitted tokens distributed exactly as the target samples them
(Leviathan et al., 2023; Chen et al., 2023):

* Point-mass proposals (n-gram: the draft puts all its mass on one token x): the sampler draws the
  token y of every row exactly as it would without speculation (`executor.sampler.sample`: the
  same temperature, top-k, top-p, bans and per-(seed, position) noise) and x_j is accepted while
  y_j == x_j. That is rejection sampling with q = delta(x): P(accept) = p(x), and on rejection y is
  distributed as p with x removed, renormalized. A seeded or greedy request so emits exactly the
  tokens it emits without speculation; greedy acceptance is exact argmax matching.
* Draft-model proposals (x_j sampled from the draft's q_j): x_j is accepted with probability
  min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from the residual
  max(0, p_j - q_j), normalized; after d acceptances the bonus is drawn from p_d. p and q are the
  processed distributions (temperature, top-k, top-p, as the sampler makes them). The uniform and
  the residual's noise come from the same per-(seed, position) generators as the sampler's. Greedy
  rows accept while the draft's token is the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedserve.executor.sampler import (
    SamplingParams,
    TokenMasks,
    ban_tokens,
    exponential_noise,
    mask_top_k_top_p,
    mix_seed,
    sample,
)
from pagedserve.executor.transfer import int64_to_device, to_device
from pagedserve.kernels import layers


@dataclass(frozen=True)
class LayoutIndex:
    """A `VerifyLayout`'s index tensors on the device: [S, K + 1] `padded_rows`, its [S, K]
    proposal mask, and the [rows] mask of each sequence's last row (the masks int64 0 / 1, as
    copied: a cast would be one more kernel per step)."""

    rows: torch.Tensor
    valid: torch.Tensor
    last: torch.Tensor


@dataclass(frozen=True)
class VerifyLayout:
    """Where each speculating sequence's rows are. S sequences; row j of sequence i is
    `offsets[i] + j`, j in [0, num_drafts[i]]; K = max(num_drafts).

    Attributes:
        num_drafts: [S] host ints, d_i >= 1.
        offsets: [S] host ints, the first row of each sequence.
        index: its index tensors on the device (`stage_layout`: one copy with the caller's own
            arrays); None: acceptance copies them itself.
    """

    num_drafts: np.ndarray
    offsets: np.ndarray
    index: LayoutIndex | None = None

    @property
    def num_rows(self) -> int:
        return int(self.num_drafts.sum() + len(self.num_drafts))

    @property
    def width(self) -> int:
        return int(self.num_drafts.max()) + 1

    def padded_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """[S, K + 1] row index of each (sequence, j), clamped to the sequence's last row, and the
        [S, K] mask of the j that are proposals."""
        j = np.arange(self.width)[None, :]
        rows = self.offsets[:, None] + np.minimum(j, self.num_drafts[:, None])
        valid = j[:, :-1] < self.num_drafts[:, None]
        return rows.astype(np.int64), valid

    def last_rows(self) -> np.ndarray:
        """[rows] bool: each sequence's last row (the bonus token's)."""
        last = np.zeros(self.num_rows, dtype=bool)
        last[self.offsets + self.num_drafts] = True
        return last


def stage_layout(
    layout: VerifyLayout, device: torch.device, extra: Sequence[np.ndarray] = ()
) -> tuple[VerifyLayout, list[torch.Tensor]]:
    """`layout` with its index tensors on the device, and the int arrays `extra` there too, in one
    non-blocking copy: a verification step stages everything its acceptance needs at once."""
    rows, valid = layout.padded_rows()
    arrays = [rows.reshape(-1), valid.reshape(-1).astype(np.int64), layout.last_rows().astype(np.int64)]
    rows_d, valid_d, last_d, *extra_d = int64_to_device([*arrays, *extra], device)
    index = LayoutIndex(rows_d.view(rows.shape), valid_d.view(valid.shape), last_d)
    return replace(layout, index=index), extra_d


def _index(layout: VerifyLayout, device: torch.device) -> LayoutIndex:
    index = layout.index if layout.index is not None else stage_layout(layout, device)[0].index
    assert index is not None
    return index


@dataclass(frozen=True)
class VerifyOutput:
    """[S, K + 1] tokens (the first counts[i] of row i are emitted), [S] counts (accepted + 1),
    [S] the last emitted token (the next step's input), [S, K + 1] logprobs or None."""

    token_ids: torch.Tensor
    counts: torch.Tensor
    last_token: torch.Tensor
    logprobs: torch.Tensor | None


def _row_params(params: Sequence[SamplingParams], layout: VerifyLayout, positions: Sequence[int]):
    """Per verification row: its sequence's params and the position its token takes."""
    row_params, row_positions = [], []
    for p, d, pos in zip(params, layout.num_drafts.tolist(), positions, strict=True):
        row_params += [p] * (d + 1)
        row_positions += range(pos, pos + d + 1)
    return row_params, row_positions


def _gather_emitted(
    tokens: torch.Tensor,
    accept: torch.Tensor,
    layout: VerifyLayout,
    logprobs: torch.Tensor | None,
) -> VerifyOutput:
    """From per-row emitted candidates and per-row acceptance of the proposals: the emitted runs."""
    index = _index(layout, tokens.device)
    accepted = accept[index.rows[:, :-1]] * index.valid  # int64: the proposals accepted
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    padded = tokens[index.rows]
    last = padded.gather(1, num_accepted[:, None]).squeeze(1)
    lp = None if logprobs is None else logprobs[index.rows]
    return VerifyOutput(padded, num_accepted + 1, last, lp)


def accept_greedy(
    logits: torch.Tensor, proposals: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance of S sequences of k proposals each, their k + 1 rows back to back: what
    `verify_point_mass` computes for greedy rows with no ban, mask or logprob (each row's token is
    its argmax, a proposal is accepted while it equals it, and an accepted proposal is the argmax,
    so the emitted run is the argmax of every row up to the first rejection), in a fixed number of
    kernels on fixed shapes, so a CUDA graph can hold it (`StepGraphs.capture_acceptance`).

    Args:
        logits: [S * (k + 1), vocab] the verification rows.
        proposals: [S, k] int64.

    Returns:
        [S, k + 1] tokens (the first counts[i] of row i are emitted), [S] counts (accepted + 1),
        [S] the last emitted token (the next step's input).
    """
    num, k = proposals.shape
    target = layers.argmax(logits).view(num, k + 1)
    num_accepted = (target[:, :k] == proposals).cumprod(dim=1).sum(dim=1)  # (bool: int64)
    last = target.gather(1, num_accepted[:, None]).squeeze(1)
    return target, num_accepted + 1, last


def verify_point_mass(
    logits: torch.Tensor,
    draft_ids: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    layout: VerifyLayout,
    banned: Sequence[Sequence[int]] | None = None,
    masks: TokenMasks | None = None,
) -> VerifyOutput:
    """Acceptance of point-mass proposals (n-gram).

    Args:
        logits: [rows, vocab] float32, the verification rows (`layout`).
        draft_ids: [rows] int64 on the device: row j's proposal (row j + 1's input token); the
            value at each sequence's last row is ignored.
        params: per sequence.
        positions: per sequence, the position its row-0 token takes (its tokens so far).
        banned: per row, ids it may not sample (min_tokens: the row's own count of generated
            tokens decides).
        masks: structured outputs: the rows' grammar masks (each after the proposals before it).
    """
    row_params, row_positions = _row_params(params, layout, positions)
    result = sample(logits, row_params, row_positions, banned, masks)
    accept = result.token_ids == draft_ids
    return _gather_emitted(result.token_ids, accept, layout, result.logprobs)


@dataclass(frozen=True)
class ProbsProcessing:
    """`processed_probs`' per-row parameters on the device, made once for rows processed again and
    again (a draft model's proposal passes: one copy per step instead of one per pass)."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None  # None: no row has top-k or top-p
    top_p: torch.Tensor | None
    greedy_rows: torch.Tensor | None  # None: no greedy row


def probs_processing(params: Sequence[SamplingParams], vocab: int, device: torch.device) -> ProbsProcessing:
    temperature = to_device([p.temperature if not p.greedy else 1.0 for p in params], torch.float32, device)
    top_k = top_p = greedy_rows = None
    if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
        top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)
        top_p = to_device([p.top_p for p in params], torch.float32, device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        greedy_rows = to_device(greedy, torch.int64, device)
    return ProbsProcessing(temperature, top_k, top_p, greedy_rows)


def processed_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams], processing: ProbsProcessing | None = None
) -> torch.Tensor:
    """The distribution each row samples from, as the sampler makes it: temperature, then top-k
    and top-p; a greedy row is a point mass on its argmax. `processing`: the params' tensors
    (`probs_processing`), when made already."""
    if processing is None:
        processing = probs_processing(params, logits.shape[1], logits.device)
    scaled = logits.float() / processing.temperature[:, None]
    if processing.top_k is not None:
        scaled = mask_top_k_top_p(scaled, processing.top_k, processing.top_p)
    probs = scaled.softmax(dim=-1)
    rows = processing.greedy_rows
    if rows is not None:
        point = torch.zeros_like(probs[rows]).scatter_(1, logits[rows].argmax(dim=-1, keepdim=True), 1.0)
        probs[rows] = point
    return probs


# Seeded draft proposals draw their noise from mix_seed(seed ^ _DRAFT_SALT, position): independent of
# the target's (the residual at a rejection must not reuse the noise the proposal was drawn with).
_DRAFT_SALT = 0x2545F4914F6CDD1D


def draft_sampling_params(params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """The params a draft model samples its proposals with: the same, seeds salted."""
    return [p if p.seed is None else replace(p, seed=p.seed ^ _DRAFT_SALT) for p in params]


def _uniforms(
    params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device
) -> torch.Tensor:
    """One U(0, 1) per row: seeded rows from a generator of mix_seed(seed, position) (offset from
    the sampler's noise stream so the two never coincide), the rest from the global one."""
    u = torch.rand(len(params), device=device)
    for i, p in enumerate(params):
        if p.seed is not None:
            g = torch.Generator(device=device).manual_seed(mix_seed(p.seed ^ 0x5BD1E995, positions[i]))
            u[i] = torch.rand(1, generator=g, device=device)[0]
    return u


def verify_draft_model(
    logits: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    layout: VerifyLayout,
    banned: Sequence[Sequence[int]] | None = None,
) -> VerifyOutput:
    """Acceptance of proposals sampled from a draft model's distributions.

    Args:
        logits: [rows, vocab] the target's verification rows (`layout`).
        draft_ids: [rows] int64, row j's proposal (ignored at each sequence's last row).
        draft_probs: [rows, vocab] the processed draft distribution each proposal was drawn from
            (ignored at each sequence's last row); None only if every request is greedy.
        params, positions, banned: as `verify_point_mass`.
    """
    if all(p.greedy for p in params):  # argmax matching: no distribution is needed
        return verify_point_mass(logits, draft_ids, params, positions, layout, banned)
    assert draft_probs is not None, "sampled proposals need the draft's distributions"
    row_params, row_positions = _row_params(params, layout, positions)
    if banned is not None and any(banned):
        logits = ban_tokens(logits, banned)
    p = processed_probs(logits, row_params)
    idx = draft_ids.clamp(min=0)[:, None]
    p_x = p.gather(1, idx).squeeze(1)
    q_x = draft_probs.gather(1, idx).squeeze(1)
    u = _uniforms(row_params, row_positions, logits.device)
    accept = u * q_x <= p_x  # min(1, p/q) >= u, with q_x > 0 for a token the draft sampled
    # The token emitted at a row if that row is where the run ends: the residual max(0, p - q) at a
    # rejection; p itself at a sequence's last row (the bonus). Drawn with the sampler's race.
    index = _index(layout, logits.device)
    last = index.last.bool()
    residual = torch.where(last[:, None], p, (p - draft_probs).clamp(min=0))
    # A residual of all zeros (p == q) cannot be reached by a rejection; keep p there.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
    noise = exponential_noise(residual, row_params, row_positions)
    tokens = (residual / noise).argmax(dim=-1)
    greedy = [i for i, rp in enumerate(row_params) if rp.greedy]
    if greedy:
        g = to_device(greedy, torch.int64, logits.device)
        tokens[g] = logits[g].argmax(dim=-1)
        accept[g] = draft_ids[g] == tokens[g]
    accept &= ~last
    tokens = torch.where(accept, draft_ids, tokens)  # an accepted row emits its proposal
    logprobs = None
    if any(rp.return_logprobs for rp in row_params):
        logprobs = logits.float().log_softmax(dim=-1)
    out = _gather_emitted(tokens, accept, replace(layout, index=index), None)
    if logprobs is not None:
        emitted = logprobs[index.rows.reshape(-1)].gather(1, out.token_ids.reshape(-1, 1))
        out = VerifyOutput(out.token_ids, out.counts, out.last_token, emitted.reshape(out.token_ids.shape))
    return out
