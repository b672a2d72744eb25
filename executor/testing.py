"""Toy schedulers that build StepPlans by hand: for tests, benchmarks and poking at an executor.

It is deliberately naive (no budget, no prefix cache, no policy) and never used by the serving
path. It mirrors the executor's bookkeeping: after each step a sequence's computed count grows by
what was planned, and a sequence that reached its end gets the sampled token appended.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from protos import executor_pb2


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
            seq.block_ids.extend(fresh)
            if seq.held:
                running.append(
                    executor_pb2.RunningRequest(seq_id=seq_id, num_new_tokens=n, new_block_ids=fresh)
                )
            else:
                new.append(
                    executor_pb2.NewRequest(
                        seq_id=seq_id,
                        token_ids=seq.token_ids,
                        num_computed_tokens=seq.num_computed,
                        num_new_tokens=n,
                        block_ids=seq.block_ids,
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


class AheadScheduler:
    """Plans the way the real scheduler does, one plan in flight ahead: a request that samples in
    step N gets its decode token in step N+1, planned before output N is read, so every decode
    token it schedules is one whose value only the executor's device knows.

    Greedy, no preemption: waiting prompts are admitted whole, oldest first, while the token budget
    (and max_num_seqs) allows; every admitted request then decodes one token per step.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.free = list(range(num_gpu_blocks))
        random.Random(seed).shuffle(self.free)
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}  # admitted requests, counting samples still in flight
        self.block_ids: dict[int, list[int]] = {}  # admitted requests' blocks
        self.outputs: dict[int, list[int]] = {}
        self._retired: list[int] = []
        self._step_id = 0

    def add(self, seq_id: int, prompt: Iterable[int]) -> None:
        self.waiting[seq_id] = list(prompt)
        self.outputs[seq_id] = []

    def _blocks(self, seq_id: int, end: int) -> list[int]:
        held = self.block_ids[seq_id]
        new = [self.free.pop() for _ in range(max(0, -(-end // self.block_size) - len(held)))]
        held.extend(new)
        return new

    def retire(self, seq_id: int) -> None:
        """Finishes an admitted request: the next plan removes it and its blocks are free again."""
        del self.num_tokens[seq_id]
        self.free.extend(self.block_ids.pop(seq_id))
        self._retired.append(seq_id)

    def plan(self) -> executor_pb2.StepPlan:
        self._step_id += 1
        plan = executor_pb2.StepPlan(step_id=self._step_id, removed_seq_ids=self._retired)
        self._retired = []
        budget = self.budget
        for seq_id in self.num_tokens:
            new_blocks = self._blocks(seq_id, self.num_tokens[seq_id])
            plan.running.append(
                executor_pb2.RunningRequest(seq_id=seq_id, num_new_tokens=1, new_block_ids=new_blocks)
            )
            self.num_tokens[seq_id] += 1
            budget -= 1
        for seq_id, prompt in list(self.waiting.items()):
            if len(prompt) > budget or len(self.num_tokens) >= self.max_num_seqs:
                break
            del self.waiting[seq_id]
            self.block_ids[seq_id] = []
            plan.new_requests.append(
                executor_pb2.NewRequest(
                    seq_id=seq_id, token_ids=prompt, num_new_tokens=len(prompt),
                    block_ids=self._blocks(seq_id, len(prompt)),
                )
            )  # fmt: skip
            self.num_tokens[seq_id] = len(prompt) + 1
            budget -= len(prompt)
        return plan

    def observe(self, output: executor_pb2.StepOutput) -> None:
        for seq_id, token in zip(output.seq_ids, output.token_ids, strict=True):
            self.outputs[seq_id].append(token)


def drive_ahead(runner, scheduler: AheadScheduler, steps: int) -> None:
    """Runs `steps` plans through a ModelRunner as the service does: plan N+1 is launched before
    step N is finished."""
    in_flight: deque = deque()
    for _ in range(steps):
        in_flight.append(runner.launch(scheduler.plan()))
        if len(in_flight) == 2:
            scheduler.observe(runner.finish(in_flight.popleft()))
    while in_flight:
        scheduler.observe(runner.finish(in_flight.popleft()))
