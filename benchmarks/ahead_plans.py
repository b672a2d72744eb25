"""Step plans built by hand, one plan in flight ahead, for the executor benchmarks
(`benchmarks.step`, `benchmarks.breakdown`) and the pipeline tests.

Deliberately naive (no prefix cache, no preemption) and never used by the serving path.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable

from pagedserve.protos import executor_pb2


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

    def _blocks(self, seq_id: int, end: int) -> tuple[int, list[int]]:
        """(table index of the new blocks, the new blocks) to hold `end` tokens."""
        held = self.block_ids[seq_id]
        first = len(held)
        new = [self.free.pop() for _ in range(max(0, -(-end // self.block_size) - first))]
        held.extend(new)
        return first, new

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
            first, new_blocks = self._blocks(seq_id, self.num_tokens[seq_id])
            tables = [executor_pb2.BlockTable(first_index=first, block_ids=new_blocks)] if new_blocks else []
            plan.running.append(
                executor_pb2.RunningRequest(seq_id=seq_id, num_new_tokens=1, new_blocks=tables)
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
                    block_tables=[executor_pb2.BlockTable(block_ids=self._blocks(seq_id, len(prompt))[1])],
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
