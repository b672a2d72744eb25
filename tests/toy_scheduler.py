"""A toy scheduler that builds StepPlans by hand, for the executor tests.

`AheadScheduler` (plans one step ahead, as the real scheduler does) lives with the benchmarks that
use it, `benchmarks.ahead_plans`; it is re-exported here for the tests.

It is deliberately naive (no budget, no prefix cache, no policy) and never used by the serving
path. It mirrors the executor's bookkeeping: after each step a sequence's computed count grows by
what was planned, and a sequence that reached its end gets the sampled token appended.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from benchmarks.ahead_plans import AheadScheduler, drive_ahead
from pagedserve.protos import executor_pb2

__all__ = ["AheadScheduler", "ToyScheduler", "ToySequence", "drive_ahead"]


@dataclass
class ToySequence:
    seq_id: int
    token_ids: list[int]
    sampling: executor_pb2.Sampling
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    cpu_block_ids: list[int] = field(default_factory=list)
    held: bool = False  # does the executor hold its state?
    num_prompt: int = 0

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt :]


class ToyScheduler:
    """Allocates blocks from a shuffled free list (so tables are non-contiguous) and emits plans."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.block_size = block_size
        self.free_gpu = list(range(num_gpu_blocks))
        rng.shuffle(self.free_gpu)
        self.free_cpu = list(range(num_cpu_blocks))
        self.seqs: dict[int, ToySequence] = {}
        self._step_id = 0
        self._planned: dict[int, int] = {}

    def add(self, seq_id: int, prompt: Iterable[int], sampling: executor_pb2.Sampling | None = None) -> None:
        tokens = list(prompt)
        self.seqs[seq_id] = ToySequence(
            seq_id, tokens, sampling or executor_pb2.Sampling(), num_prompt=len(tokens)
        )

    def plan(
        self,
        num_new: Mapping[int, int] | None = None,
        *,
        remove: Iterable[int] = (),
        swap_out: Iterable[int] = (),
        swap_in: Iterable[int] = (),
    ) -> executor_pb2.StepPlan:
        """The next plan.

        Args:
            num_new: tokens to compute per seq_id; None = every known sequence computes all it lacks.
                Sequences absent from a given mapping are not scheduled.
            remove: drop these (free their blocks; re-adding later recomputes from scratch).
            swap_out: move these to CPU blocks and drop them from the executor.
            swap_in: bring these back into fresh GPU blocks; they are re-sent as new requests.
        """
        self._step_id += 1
        plan = executor_pb2.StepPlan(step_id=self._step_id)
        for seq_id in swap_out:
            seq = self.seqs[seq_id]
            seq.cpu_block_ids = [self.free_cpu.pop() for _ in seq.block_ids]
            plan.swap_out.extend(
                executor_pb2.BlockMove(src=g, dst=c)
                for g, c in zip(seq.block_ids, seq.cpu_block_ids, strict=True)
            )
            self._release(seq)
            plan.removed_seq_ids.append(seq_id)
        for seq_id in remove:
            seq = self.seqs[seq_id]
            self._release(seq)
            seq.num_computed = 0
            plan.removed_seq_ids.append(seq_id)
        for seq_id in swap_in:
            seq = self.seqs[seq_id]
            seq.block_ids = [self.free_gpu.pop() for _ in seq.cpu_block_ids]
            plan.swap_in.extend(
                executor_pb2.BlockMove(src=c, dst=g)
                for c, g in zip(seq.cpu_block_ids, seq.block_ids, strict=True)
            )
            self.free_cpu.extend(seq.cpu_block_ids)
            seq.cpu_block_ids = []
        if num_new is None:
            num_new = {
                s.seq_id: len(s.token_ids) - s.num_computed for s in self.seqs.values() if not s.cpu_block_ids
            }
        new, running = [], []
        self._planned = dict(num_new)
        for seq_id, n in num_new.items():
            seq = self.seqs[seq_id]
            needed = -(-(seq.num_computed + n) // self.block_size) - len(seq.block_ids)
            fresh = [self.free_gpu.pop() for _ in range(max(needed, 0))]
            first = len(seq.block_ids)
            seq.block_ids.extend(fresh)
            if seq.held:
                tables = [executor_pb2.BlockTable(first_index=first, block_ids=fresh)] if fresh else []
                running.append(
                    executor_pb2.RunningRequest(seq_id=seq_id, num_new_tokens=n, new_blocks=tables)
                )
            else:
                new.append(
                    executor_pb2.NewRequest(
                        seq_id=seq_id,
                        token_ids=seq.token_ids,
                        num_computed_tokens=seq.num_computed,
                        num_new_tokens=n,
                        block_tables=[executor_pb2.BlockTable(block_ids=seq.block_ids)],
                        sampling=seq.sampling,
                    )
                )
                seq.held = True
        plan.new_requests.extend(new)
        plan.running.extend(running)
        return plan

    def observe(self, output: executor_pb2.StepOutput) -> dict[int, int]:
        """Books the step's results; returns {seq_id: sampled token}."""
        sampled = dict(zip(output.seq_ids, output.token_ids, strict=True))
        for seq_id, n in self._planned.items():
            seq = self.seqs[seq_id]
            seq.num_computed += n
            reached_end = seq.num_computed == len(seq.token_ids)
            if reached_end != (seq_id in sampled):
                raise AssertionError(
                    f"seq {seq_id}: reached_end={reached_end} but sampled={seq_id in sampled}"
                )
            if reached_end:
                seq.token_ids.append(sampled[seq_id])
        return sampled

    def _release(self, seq: ToySequence) -> None:
        # Freed blocks go to the end of the free list, so the next allocation reuses them first: a
        # stale read of a freed block then shows up as a wrong token.
        self.free_gpu.extend(reversed(seq.block_ids))
        seq.block_ids = []
        seq.held = False
