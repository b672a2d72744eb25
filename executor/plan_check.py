"""Checks a StepPlan in full against what the executor holds, before any of it is applied.

The scheduler owns every decision, so a plan that contradicts the executor's state (an unknown
sequence, a block id beyond the pool, more tokens than a sequence has) is a protocol error: it is
refused with a message naming what was wrong (the service turns it into INVALID_ARGUMENT), and the
executor's state and pool stay exactly as they were.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedserve.executor.sampler import SamplingParams
from pagedserve.protos import executor_pb2


class PlanError(ValueError):
    """A StepPlan that contradicts the executor's state or pool; nothing of it was applied."""


class HeldRequest(Protocol):
    """What validation reads of a request the executor holds."""

    num_computed: int
    num_tokens: int
    table_ends: list[int]  # per KV-cache group


@dataclass(frozen=True)
class PlanLimits:
    """The executor's fixed bounds, as a plan must respect them."""

    vocab_size: int
    max_model_len: int
    block_size: int
    max_blocks_per_seq: int
    num_device_blocks: int
    num_cpu_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_held_requests: int
    sliding_windows: tuple[int | None, ...] = (None,)  # per KV-cache group (executor.kv_groups)
    has_draft_model: bool = False  # speculative decoding: proposals may come without their ids
    num_disk_blocks: int = 0  # the disk tier's slots (0: no disk tier)


def sampling_from_proto(s: executor_pb2.Sampling) -> SamplingParams:
    """Proto3 cannot tell an unset top_p from 0, so top_p <= 0 means off, like 1."""
    top_p = s.top_p if 0 < s.top_p < 1 else 1.0
    return SamplingParams(
        temperature=s.temperature,
        top_p=top_p,
        top_k=s.top_k,
        seed=s.seed if s.has_seed else None,
        return_logprobs=s.return_logprobs,
        return_prompt_logprobs=s.return_prompt_logprobs,
        min_tokens=s.min_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
    )


def validate_plan(
    plan: executor_pb2.StepPlan, held: Mapping[int, HeldRequest], limits: PlanLimits
) -> list[SamplingParams]:
    """Checks the whole plan against the held requests; returns the new requests' sampling params.

    Raises:
        PlanError: naming the first inconsistency found.
    """
    _check_moves("swap_out", plan.swap_out, limits.num_device_blocks, limits.num_cpu_blocks)
    _check_moves("swap_in", plan.swap_in, limits.num_cpu_blocks, limits.num_device_blocks)
    _check_moves("offload", plan.offload, limits.num_device_blocks, limits.num_cpu_blocks)
    _check_moves("load", plan.load, limits.num_cpu_blocks, limits.num_device_blocks)
    _check_moves("spill", plan.spill, limits.num_cpu_blocks, limits.num_disk_blocks)
    _check_moves("fetch", plan.fetch, limits.num_disk_blocks, limits.num_cpu_blocks)
    _check_moves("spill_ahead", plan.spill_ahead, limits.num_cpu_blocks, limits.num_disk_blocks)
    # Removing a sequence we do not hold is allowed (idempotent), e.g. an abort racing its finish.
    kept = set(held).difference(plan.removed_seq_ids)
    seen: set[int] = set()
    sampling: set[int] = set()  # the requests whose computed tokens reach their end in this step
    num_drafts: dict[int, int] = {}  # speculative decoding: the verified requests' proposals
    total_tokens = 0
    params: list[SamplingParams] = []
    for req in plan.new_requests:
        where = f"new request seq_id={req.seq_id}"
        if req.seq_id in kept:
            raise PlanError(f"{where}: already held by the executor (not removed first)")
        if req.seq_id in seen:
            raise PlanError(f"{where}: appears twice in the plan")
        seen.add(req.seq_id)
        if not req.token_ids:
            raise PlanError(f"{where}: has no token_ids")
        _check_request_tokens(where, req, limits.vocab_size)
        _check_tables(where, limits, req.block_tables, req.num_computed_tokens, [0] * len(req.block_tables))
        _check_span(
            where,
            limits,
            req.num_computed_tokens,
            req.num_new_tokens,
            len(req.token_ids),
            table_ends=[t.first_index + len(t.block_ids) for t in req.block_tables],
            unchecked_blocks=[b for t in req.block_tables for b in t.block_ids],
        )
        try:
            params.append(sampling_from_proto(req.sampling))
        except ValueError as e:
            raise PlanError(f"{where}: {e}") from None
        if req.num_new_tokens and req.num_computed_tokens + req.num_new_tokens == len(req.token_ids):
            sampling.add(req.seq_id)
        total_tokens += req.num_new_tokens
    for req in plan.running:
        where = f"running seq_id={req.seq_id}"
        if req.seq_id not in kept:
            raise PlanError(f"{where}: unknown to the executor (never added, or removed)")
        if req.seq_id in seen:
            raise PlanError(f"{where}: appears twice in the plan")
        seen.add(req.seq_id)
        state = held[req.seq_id]
        ends = state.table_ends
        if req.new_blocks:
            _check_tables(where, limits, req.new_blocks, state.num_computed, ends)
            ends = [t.first_index + len(t.block_ids) for t in req.new_blocks]
        num_draft = req.num_draft_tokens
        if num_draft or req.draft_token_ids:
            _check_drafts(where, req, state, limits)
        _check_span(
            where,
            limits,
            state.num_computed,
            req.num_new_tokens,
            state.num_tokens + num_draft,  # proposals follow its known tokens
            table_ends=ends,
            unchecked_blocks=[b for t in req.new_blocks for b in t.block_ids],  # held ones: checked
        )
        if req.num_new_tokens and state.num_computed + req.num_new_tokens - num_draft == state.num_tokens:
            sampling.add(req.seq_id)
            if num_draft:
                num_drafts[req.seq_id] = num_draft
        total_tokens += req.num_new_tokens
    if total_tokens > limits.max_num_batched_tokens:
        raise PlanError(
            f"plan computes {total_tokens} tokens > max_num_batched_tokens {limits.max_num_batched_tokens}"
        )
    _check_masks(plan, sampling, limits.vocab_size, num_drafts)
    _check_late_masked(plan, sampling, num_drafts)
    if len(seen) > limits.max_num_seqs:
        raise PlanError(f"plan schedules {len(seen)} sequences > max_num_seqs {limits.max_num_seqs}")
    if len(kept) + len(plan.new_requests) > limits.max_held_requests:
        raise PlanError(
            f"the executor would hold {len(kept) + len(plan.new_requests)} requests > max_num_seqs "
            f"{limits.max_held_requests} (remove finished requests first)"
        )
    return params


def _check_drafts(
    where: str, req: executor_pb2.RunningRequest, state: HeldRequest, limits: PlanLimits
) -> None:
    """Speculative decoding: proposals follow the request's last token, so the step samples it;
    their ids come with them unless the executor has a draft model to propose them."""
    num_draft = req.num_draft_tokens
    if len(req.draft_token_ids) > num_draft or num_draft >= max(req.num_new_tokens, 1):
        raise PlanError(
            f"{where}: {len(req.draft_token_ids)} draft_token_ids, num_draft_tokens {num_draft} of "
            f"num_new_tokens {req.num_new_tokens} (proposals follow at least one token)"
        )
    if state.num_computed + req.num_new_tokens - num_draft != state.num_tokens:
        raise PlanError(
            f"{where}: {num_draft} proposals must follow its last token (num_computed "
            f"{state.num_computed} + {req.num_new_tokens - num_draft} != its {state.num_tokens} tokens)"
        )
    if not req.draft_token_ids and limits.has_draft_model and req.num_new_tokens - num_draft != 1:
        raise PlanError(f"{where}: a draft model's proposals follow exactly one token")
    if len(req.draft_token_ids) != num_draft and not (limits.has_draft_model and not req.draft_token_ids):
        raise PlanError(
            f"{where}: {num_draft} proposals without their draft_token_ids, and the executor has no "
            "draft model"
        )
    if req.draft_token_ids and max(req.draft_token_ids) >= limits.vocab_size:
        raise PlanError(
            f"{where}: draft token id {max(req.draft_token_ids)} >= vocab_size {limits.vocab_size}"
        )


def mask_words(vocab_size: int) -> int:
    """int32 words per token-bitmask row."""
    return (vocab_size + 31) // 32


def _check_masks(
    plan: executor_pb2.StepPlan, sampling: set[int], vocab_size: int, num_drafts: Mapping[int, int]
) -> None:
    """Structured outputs: one mask row per listed request, each of which samples in this step;
    a verified request (speculative decoding) has num_draft_tokens + 1 rows in a row, one per
    position it samples at."""
    if not plan.masked_seq_ids and not plan.mask_rows and not plan.token_bitmask:
        return  # (most plans: nothing to check)
    masked = list(plan.masked_seq_ids)
    rows = Counter(masked)
    for seq_id, count in rows.items():
        if seq_id not in sampling:
            raise PlanError(f"masked_seq_ids: seq_id={seq_id} does not sample in this step")
        expected = num_drafts.get(seq_id, 0) + 1  # one per position it samples at
        if count != expected:
            times = "twice" if count == 2 else f"{count} times"
            raise PlanError(f"masked_seq_ids: seq_id={seq_id} appears {times}; it samples at {expected}")
        first = masked.index(seq_id)
        if masked[first : first + count] != [seq_id] * count:
            raise PlanError(f"masked_seq_ids: seq_id={seq_id}'s rows are not consecutive")
    num_rows = _num_mask_rows(plan.mask_rows, len(masked), "mask_rows")
    expected = num_rows * mask_words(vocab_size) * 4
    if len(plan.token_bitmask) != expected:
        raise PlanError(
            f"token_bitmask: {len(plan.token_bitmask)} bytes, {num_rows} masks of vocab_size "
            f"{vocab_size} take {expected}"
        )


def _num_mask_rows(rows: Sequence[int], num_masks: int, where: str) -> int:
    """The rows a token_bitmask holds: one per mask, or with shared rows (one index per mask)
    each distinct mask once, rows 0 to the highest index named."""
    if not rows:
        return num_masks
    if len(rows) != num_masks:
        raise PlanError(f"{where}: {len(rows)} row indexes for {num_masks} masks")
    return max(rows) + 1


def _check_late_masked(
    plan: executor_pb2.StepPlan, sampling: set[int], num_drafts: Mapping[int, int]
) -> None:
    """Structured outputs, masks behind the plan: each listed request samples one token in this
    step (no proposals: their masks are made along them, with the plan) and has no mask in it."""
    late = list(plan.late_masked_seq_ids)
    if not late:
        return
    if plan.HasField("masks"):
        raise PlanError("a StepPlan with masks set is the late masks of another plan, not a plan")
    if len(set(late)) != len(late):
        raise PlanError("late_masked_seq_ids: a seq_id appears twice")
    eager = set(plan.masked_seq_ids)
    for seq_id in late:
        if seq_id not in sampling:
            raise PlanError(f"late_masked_seq_ids: seq_id={seq_id} does not sample in this step")
        if seq_id in num_drafts:
            raise PlanError(
                f"late_masked_seq_ids: seq_id={seq_id} verifies proposals (its masks come with them)"
            )
        if seq_id in eager:
            raise PlanError(f"late_masked_seq_ids: seq_id={seq_id} also has a mask in masked_seq_ids")


def validate_masks(
    masks: executor_pb2.StepMasks, step_id: int, awaited: Sequence[int], vocab_size: int
) -> None:
    """Checks a StepMasks against the launched plan `step_id` that awaits the masks of `awaited`
    (its late_masked_seq_ids): the same step, a subset of those requests, each once, one row each.

    Raises:
        PlanError: naming the first inconsistency found.
    """
    if masks.step_id != step_id:
        raise PlanError(f"masks for step {masks.step_id}, but step {step_id} awaits its masks")
    listed = list(masks.seq_ids)
    if len(set(listed)) != len(listed):
        raise PlanError(f"masks of step {step_id}: a seq_id appears twice")
    unknown = set(listed).difference(awaited)
    if unknown:
        raise PlanError(f"masks of step {step_id}: seq_id={min(unknown)} is not in its late_masked_seq_ids")
    num_rows = _num_mask_rows(masks.rows, len(listed), f"masks of step {step_id}: rows")
    expected = num_rows * mask_words(vocab_size) * 4
    if len(masks.token_bitmask) != expected:
        raise PlanError(
            f"masks of step {step_id}: token_bitmask of {len(masks.token_bitmask)} bytes, {num_rows} "
            f"masks of vocab_size {vocab_size} take {expected}"
        )


def _check_request_tokens(where: str, req: executor_pb2.NewRequest, vocab: int) -> None:
    if max(req.token_ids) >= vocab:
        raise PlanError(f"{where}: token id {max(req.token_ids)} >= vocab_size {vocab}")
    if req.num_prompt_tokens > len(req.token_ids):
        raise PlanError(
            f"{where}: num_prompt_tokens {req.num_prompt_tokens} > its {len(req.token_ids)} tokens"
        )
    stop_ids = req.sampling.stop_token_ids
    if stop_ids and max(stop_ids) >= vocab:
        raise PlanError(f"{where}: stop token id {max(stop_ids)} >= vocab_size {vocab}")


def _check_tables(
    where: str,
    limits: PlanLimits,
    tables: Sequence[executor_pb2.BlockTable],
    num_computed: int,
    ends: Sequence[int],
) -> None:
    """One table per KV-cache group, each starting where the executor's copy ends (`ends`: 0 for a
    new request; a full-attention group's table from entry 0) and, in a sliding-window group, no
    later than the first entry the step's first query can see."""
    windows = limits.sliding_windows
    if len(tables) != len(windows):
        raise PlanError(f"{where}: {len(tables)} block tables for {len(windows)} KV-cache groups")
    for group, (table, end, window) in enumerate(zip(tables, ends, windows, strict=True)):
        if end:  # appended blocks
            if table.first_index != end:
                raise PlanError(
                    f"{where}: group {group}'s new blocks start at entry {table.first_index}, "
                    f"its table ends at {end}"
                )
            continue
        first_visible = 0 if window is None else max(0, num_computed - window + 1) // limits.block_size
        if table.first_index > first_visible:
            raise PlanError(
                f"{where}: group {group}'s table starts at entry {table.first_index}, but its first "
                f"query reads entry {first_visible}"
            )


def _check_span(
    where: str,
    limits: PlanLimits,
    num_computed: int,
    num_new: int,
    num_tokens: int,
    *,
    table_ends: Sequence[int],
    unchecked_blocks: Sequence[int],
) -> None:
    end = num_computed + num_new
    if end > num_tokens:
        raise PlanError(
            f"{where}: num_computed {num_computed} + num_new_tokens {num_new} exceeds its {num_tokens} "
            "known tokens (decode steps compute exactly the one token sampled last)"
        )
    if end > limits.max_model_len:
        raise PlanError(
            f"{where}: computes up to position {end - 1}, max_model_len is {limits.max_model_len}"
        )
    num_blocks = min(table_ends, default=0)
    if num_blocks * limits.block_size < end:
        raise PlanError(
            f"{where}: {num_blocks} blocks of {limits.block_size} tokens cannot hold {end} tokens"
        )
    if max(table_ends, default=0) > limits.max_blocks_per_seq:
        raise PlanError(
            f"{where}: a table of {max(table_ends)} blocks is longer than max_model_len "
            f"{limits.max_model_len} needs ({limits.max_blocks_per_seq} blocks)"
        )
    if unchecked_blocks and max(unchecked_blocks) >= limits.num_device_blocks:
        raise PlanError(
            f"{where}: block id {max(unchecked_blocks)} out of range "
            f"(num_gpu_blocks={limits.num_device_blocks})"
        )


def _check_moves(what: str, moves: Sequence[executor_pb2.BlockMove], num_src: int, num_dst: int) -> None:
    for move in moves:
        if move.src >= num_src or move.dst >= num_dst:
            raise PlanError(
                f"{what}: move {move.src}->{move.dst} out of range (source pool {num_src} blocks, "
                f"destination pool {num_dst} blocks)"
            )
    if len({m.dst for m in moves}) != len(moves):
        raise PlanError(f"{what}: several moves write the same destination block")
