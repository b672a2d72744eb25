"""The scheduler's policy on a simulated clock: multi-turn chat (W6) through the real `Scheduler`,
with an executor that takes the time a GPU takes instead of running a model.

On the 2-core CPU machine a real run of W6 measures the CPU, not the policy: a tiny model's
prefill costs almost nothing against the step's fixed overhead, so the trade between computing a
history and loading it, and the time a memory-bound pool makes requests wait, are not the GPU's.
This replays the workload's closed loop (a conversation's next turn `think_time` after its answer)
through the scheduling core exactly as `scheduler.replica` drives it (plans made one step ahead, at
most two in flight), and charges each step what the llama-8b shape costs on the H200 or the H100
(`H200_LLAMA_8B`, `H100_LLAMA_8B`): the decode read floor times the measured overhead, plus the
compute of the prompt tokens the step carries, plus in-step swaps; the CPU tier's loads and offloads
run beside the forward on the copy stream, and the next step waits for them.

    python -m benchmarks.policy_sim                  # W6 on 2,304 blocks: no tier, tier, tier + load budget
    python -m benchmarks.policy_sim --device h100
    python -m benchmarks.policy_sim --roofline       # a mixed step priced as the larger of the two
    python -m benchmarks.policy_sim --conversations 32 --num-gpu-blocks 1152 --json out.json

It runs W6 without a tier, with one and no limit on its loads per plan, and with one and the load
budget the replica derives on the device (`SchedulerConfig.max_num_loaded_blocks`), and reports per
run TTFT and where it went: waiting to be admitted (``queued``), admitted but not yet sampled
(``admitted``: loads, prefill chunks, re-admission after a pre-emption), TTFT by turn, the
pre-emptions and the prompt tokens computed.

What it reproduces (TTFT p50, run length): on the H200 (2026-12-04, before the load budget) no tier
1,656 ms / 23.7 s against 1,563-1,628 ms / 23.7 s measured, tier 873 ms / 16.8 s against 787-883 ms
/ 17.0 s; on the H100 (2026-12-05-h100-s2, with the budget) no tier 1,881 ms / 27.1 s against
1,786 ms / 27.3 s, tier 986 ms / 19.3 s against 996 ms / 19.8 s, and the tier's TTFT p50 by turn
within 10-25% (281 258 367 1,027 2,093 3,175 ms against 326 340 344 1,044 2,187 3,331). Pricing a
mixed step as the larger of its decode floor and its prefill compute (`--roofline`) predicted the
H100's tier run at 776 ms and an ITL p90 of 8.8 ms where 13.6 was measured: a step that carries a
prefill chunk costs about the sum of the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import logging
import statistics
import sys
from collections import deque
from dataclasses import asdict, dataclass, field

import structlog

from pagedserve.bench.workloads import LengthRange, Workload, generate_requests
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.core import Scheduler, StepPlan
from pagedserve.scheduler.kv_tier import load_budget
from pagedserve.scheduler.request import Request, RequestStatus, SamplingOptions, SeqId

GIB = 1 << 30
PLANS_IN_FLIGHT = 2  # as scheduler.replica


@dataclass(frozen=True)
class StepCost:
    """What a step costs on one GPU.

    Attributes:
        weight_bytes: read by every forward (the weights).
        kv_bytes_per_token: the KV of one position, all layers.
        hbm_bytes_per_s: the device's copy bandwidth (the read floor's).
        decode_overhead: a memory-bound step's time over its read floor (ITL p50 / floor).
        seconds_per_token: a compute-bound step's time per scheduled token (prefill).
        block_bytes: one KV block (block_size positions).
        host_bytes_per_s: host <-> device copies (the tier's loads and offloads, swaps).
        additive: a step that computes prompt tokens costs their compute on top of its decode
            floor (what the H100 and the H200 measured); else the larger of the two (the roofline:
            a step of a few hundred rows reads the weights once, as a decode does).
    """

    weight_bytes: float
    kv_bytes_per_token: float
    hbm_bytes_per_s: float
    decode_overhead: float
    seconds_per_token: float
    block_bytes: float
    host_bytes_per_s: float
    additive: bool = True

    def forward_seconds(self, plan: StepPlan, context_tokens: int) -> float:
        """The forward of `plan`: its read floor (weights and the KV its requests attend to)
        times the overhead, and its tokens' compute (see `additive`); in-step swaps on top."""
        floor = (self.weight_bytes + context_tokens * self.kv_bytes_per_token) / self.hbm_bytes_per_s
        swaps = (len(plan.swap_out) + len(plan.swap_in)) * self.block_bytes / self.host_bytes_per_s
        if self.additive:
            num_decodes = sum(1 for p in plan.running if p.num_new_tokens == 1)
            compute = (plan.num_scheduled_tokens - num_decodes) * self.seconds_per_token
            return floor * self.decode_overhead + compute + swaps
        compute = plan.num_scheduled_tokens * self.seconds_per_token
        return max(floor * self.decode_overhead, compute) + swaps

    def copy_seconds(self, plan: StepPlan) -> float:
        """The copy stream's work beside the forward: the tier's loads and offloads."""
        return (len(plan.load) + len(plan.offload)) * self.block_bytes / self.host_bytes_per_s


# llama-8b shape, bf16, on the H200 (benchmarks/results/2026-12-04-h200): 15.01 GB of weights and
# 128 KiB of KV a position read at 3.87 TB/s; decode ITL p50 at 1.39x that floor (w6-tier.txt);
# ~22 us a prefill token (16 GFLOP at ~730 TFLOP/s: the no-tier run's 462k prompt tokens and 1,879
# steps take its 23.7 s; the H100, of the same compute, measured the same); the tier's copies at
# 47 GB/s (kv-tier-copy.txt), 2 MiB blocks.
H200_LLAMA_8B = StepCost(
    weight_bytes=15.01e9,
    kv_bytes_per_token=131072,
    hbm_bytes_per_s=3.87e12,
    decode_overhead=1.39,
    seconds_per_token=22e-6,
    block_bytes=16 * 131072,
    host_bytes_per_s=47e9,
)
# What the H200's executor measures for a pinned host-to-device copy at start (kv-tier-copy.txt:
# 55.3 GB/s), from which the replica sizes the tier's loads per plan (kv_tier.load_budget).
H200_HOST_LINK_BYTES_PER_S = 55.3e9
# The same shape on one H100 80GB (benchmarks/results/2026-12-05-h100-s2, W6): the executor's copy
# bandwidth 2.83 TB/s, decode ITL p50 at 1.26x of the floor (w6-tier20), a prefill token as on the
# H200 (turn 0's steps of 8,192 tokens took ~182 ms), its host link 54.5 GB/s.
H100_LLAMA_8B = dataclasses.replace(H200_LLAMA_8B, hbm_bytes_per_s=2.83e12, decode_overhead=1.26)
H100_HOST_LINK_BYTES_PER_S = 54.5e9
DEVICES = {  # --device: the step times and the host link the replica sizes the load budget from
    "h200": (H200_LLAMA_8B, H200_HOST_LINK_BYTES_PER_S),
    "h100": (H100_LLAMA_8B, H100_HOST_LINK_BYTES_PER_S),
}


@dataclass
class Turn:
    """One request of a conversation and what the simulation saw of it."""

    conversation: int
    turn: int
    new_tokens: tuple[int, ...]
    output_len: int
    sent: float = 0.0
    admitted: float | None = None  # first left the waiting queue
    first_token: float | None = None
    finished: float | None = None
    prompt_len: int = 0
    cached: int = 0
    preemptions: int = 0


@dataclass
class RunResult:
    label: str
    duration_s: float
    steps: int
    preemptions: int
    prompt_tokens_computed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    queue_mean_ms: float  # sent -> admitted
    admitted_mean_ms: float  # admitted -> first token
    queue_p50_ms: float
    admitted_p50_ms: float
    output_tok_s: float
    ttft_p50_by_turn_ms: list[float] = field(default_factory=list)
    preempted_before_first_token: int = 0


def _token(seq_id: int, position: int) -> int:
    """The "sampled" token: a fixed function of the request and position (outputs are never EOS)."""
    return 1000 + (seq_id * 7919 + position * 104729) % 30000


class Simulation:
    """W6's closed loop on a simulated clock, through one `Scheduler` (see the module doc)."""

    def __init__(self, workload: Workload, config: SchedulerConfig, cost: StepCost) -> None:
        self.core = Scheduler(config)
        self.cost = cost
        requests = generate_requests(workload, vocab_size=32000)
        self.turns = [Turn(r.conversation, r.turn, r.prompt, r.output_len) for r in requests]
        self.num_turns = workload.num_turns
        self.think = workload.think_time
        self.now = 0.0
        self._arrivals: list[tuple[float, int, int]] = []  # (time, order, turn index)
        self._order = 0
        self._live: dict[SeqId, int] = {}  # seq id -> turn index
        self._history: dict[int, list[int]] = {}  # conversation -> its whole prompt and answers
        self._gpu_free_at = 0.0
        self._copies_done_at = 0.0
        self.steps = 0
        for index, turn in enumerate(self.turns):
            if turn.turn == 0:
                self._arrive_at(0.0, index)

    def _arrive_at(self, when: float, index: int) -> None:
        heapq.heappush(self._arrivals, (when, self._order, index))
        self._order += 1

    def _admit_arrivals(self) -> None:
        while self._arrivals and self._arrivals[0][0] <= self.now:
            when, _, index = heapq.heappop(self._arrivals)
            turn = self.turns[index]
            prompt = self._history.get(turn.conversation, []) + list(turn.new_tokens)
            self._history[turn.conversation] = prompt
            turn.sent, turn.prompt_len = when, len(prompt)
            request = Request(SeqId(index), list(prompt), turn.output_len, SamplingOptions(temperature=0.0))
            self.core.add_request(request)
            self._live[request.seq_id] = index

    def _launch(self, plan: StepPlan) -> float:
        """When the executor finishes `plan`, queued behind the steps before it."""
        core = self.core
        context = 0
        for p in plan.new_requests:
            context += p.num_computed_tokens + p.num_new_tokens
        for p in plan.running:
            request = core.get_request(p.seq_id)
            context += request.num_computed_tokens if request is not None else 0
        start = max(self.now, self._gpu_free_at, self._copies_done_at)
        self._gpu_free_at = start + self.cost.forward_seconds(plan, context)
        self._copies_done_at = start + self.cost.copy_seconds(plan)
        return self._gpu_free_at

    def _note_admissions(self) -> None:
        for seq_id, index in self._live.items():
            turn = self.turns[index]
            request = self.core.get_request(seq_id)
            if turn.admitted is None and request is not None and request.status is not RequestStatus.WAITING:
                turn.admitted = self.now

    def _take_output(self, plan: StepPlan) -> None:
        core = self.core
        tokens = []
        for seq_id in plan.sampling_seq_ids:
            request = core.get_request(seq_id)
            position = request.num_sampled_tokens if request is not None else 0
            tokens.append(_token(seq_id, position))
        for request in core.process_output(plan.step_id, list(plan.sampling_seq_ids), tokens):
            index = self._live[request.seq_id]
            turn = self.turns[index]
            if turn.first_token is None:
                turn.first_token = self.now
                turn.cached = request.num_cached_prompt_tokens
                turn.preemptions = request.num_preemptions
            if request.status is RequestStatus.FINISHED:
                turn.finished = self.now
                del self._live[request.seq_id]
                self._history[turn.conversation] += request.output_token_ids
                if turn.turn + 1 < self.num_turns:
                    self._arrive_at(self.now + self.think, index + 1)

    def run(self) -> None:
        """`ExecutorReplica._step_loop` with the executor's time simulated."""
        in_flight: deque[tuple[StepPlan, float]] = deque()
        while self._arrivals or self._live or in_flight:
            self._admit_arrivals()
            plan = None
            if len(in_flight) < PLANS_IN_FLIGHT:
                plan = self.core.schedule()
                self._note_admissions()
                if plan.is_empty:
                    plan = None
                else:
                    in_flight.append((plan, self._launch(plan)))
                    self.steps += 1
            if in_flight and (plan is None or len(in_flight) >= PLANS_IN_FLIGHT):
                done, end = in_flight.popleft()
                self.now = max(self.now, end)
                self._admit_arrivals()
                self._take_output(done)
            elif not in_flight:
                if not self._arrivals:
                    raise RuntimeError("requests left that the scheduler does not plan")
                self.now = max(self.now, self._arrivals[0][0])

    def result(self, label: str) -> RunResult:
        turns = self.turns
        ttft = [(t.first_token - t.sent) * 1e3 for t in turns]  # type: ignore[operator]
        queue = [(t.admitted - t.sent) * 1e3 for t in turns]  # type: ignore[operator]
        admitted = [(t.first_token - t.admitted) * 1e3 for t in turns]  # type: ignore[operator]
        by_turn = [
            statistics.median(x for t, x in zip(turns, ttft, strict=True) if t.turn == k)
            for k in range(self.num_turns)
        ]
        stats = self.core.stats
        duration = max(t.finished for t in turns)  # type: ignore[type-var]
        return RunResult(
            label=label,
            duration_s=duration,
            steps=self.steps,
            preemptions=stats.num_preemptions,
            prompt_tokens_computed=stats.prompt_tokens_computed,
            ttft_p50_ms=_pct(ttft, 50),
            ttft_p90_ms=_pct(ttft, 90),
            ttft_p99_ms=_pct(ttft, 99),
            ttft_mean_ms=statistics.fmean(ttft),
            queue_mean_ms=statistics.fmean(queue),
            admitted_mean_ms=statistics.fmean(admitted),
            queue_p50_ms=_pct(queue, 50),
            admitted_p50_ms=_pct(admitted, 50),
            output_tok_s=sum(t.output_len for t in turns) / duration,
            ttft_p50_by_turn_ms=by_turn,
            preempted_before_first_token=sum(1 for t in turns if t.preemptions),
        )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def simulate(
    workload: Workload,
    num_gpu_blocks: int,
    tier_gib: float,
    cost: StepCost = H200_LLAMA_8B,
    swap_gib: float = 4.0,
    label: str = "",
    **config: object,
) -> RunResult:
    """One run of `workload` with `num_gpu_blocks` and a CPU tier of `tier_gib` (0: none)."""
    block_size = 16
    tier_blocks = int(tier_gib * GIB // cost.block_bytes)
    scheduler_config = SchedulerConfig(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=int(swap_gib * GIB // cost.block_bytes) + tier_blocks,
        num_cpu_offload_blocks=tier_blocks,
        max_model_len=workload.num_turns * (workload.input_len.hi + workload.output_len.hi),
        **config,  # type: ignore[arg-type]
    )
    simulation = Simulation(workload, scheduler_config, cost)
    simulation.run()
    return simulation.result(label or f"tier {tier_gib:g} GiB")


def w6(conversations: int = 64, seed: int = 1) -> Workload:
    """W6 (bench.workloads.PRESETS) with `conversations` conversations."""
    return Workload(
        "multi-turn",
        conversations,
        LengthRange(256, 256),
        LengthRange(128, 128),
        seed=seed,
        num_turns=6,
        think_time=0.5,
    )


def _print(results: list[RunResult]) -> None:
    rows = [
        (
            "TTFT p50 / p90 / p99 (ms)",
            lambda r: f"{r.ttft_p50_ms:,.0f} / {r.ttft_p90_ms:,.0f} / {r.ttft_p99_ms:,.0f}",
        ),
        ("TTFT mean (ms)", lambda r: f"{r.ttft_mean_ms:,.0f}"),
        ("  queued mean / p50 (ms)", lambda r: f"{r.queue_mean_ms:,.0f} / {r.queue_p50_ms:,.0f}"),
        ("  admitted mean / p50 (ms)", lambda r: f"{r.admitted_mean_ms:,.0f} / {r.admitted_p50_ms:,.0f}"),
        ("TTFT p50 by turn (ms)", lambda r: " ".join(f"{x:,.0f}" for x in r.ttft_p50_by_turn_ms)),
        ("duration (s)", lambda r: f"{r.duration_s:.2f}"),
        ("output tok/s", lambda r: f"{r.output_tok_s:,.0f}"),
        ("steps", lambda r: f"{r.steps:,}"),
        ("preemptions (before 1st token)", lambda r: f"{r.preemptions} ({r.preempted_before_first_token})"),
        ("prompt tokens computed", lambda r: f"{r.prompt_tokens_computed:,}"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'':{width}}  " + "  ".join(f"{r.label:>31}" for r in results))
    for name, cell in rows:
        print(f"{name:{width}}  " + "  ".join(f"{cell(r):>31}" for r in results))


def replica_load_budget(cost: StepCost = H200_LLAMA_8B, link: float = H200_HOST_LINK_BYTES_PER_S) -> int:
    """`SchedulerConfig.max_num_loaded_blocks` as `scheduler.replica` derives it on the device of
    `cost` and `link`."""
    return load_budget(int(cost.weight_bytes), cost.hbm_bytes_per_s, link, int(cost.block_bytes))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=2304)
    parser.add_argument("--tier-gib", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", choices=sorted(DEVICES), default="h200", help="whose step times")
    parser.add_argument(
        "--max-num-loaded-blocks",
        type=int,
        help="the tier's loads per plan in the last run (default: as the replica derives it on --device)",
    )
    parser.add_argument(
        "--roofline",
        action="store_true",
        help="a step costs the larger of its decode floor and its prompt tokens' compute, not their sum",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    workload = w6(args.conversations, args.seed)
    device_cost, link = DEVICES[args.device]
    cost = dataclasses.replace(device_cost, additive=not args.roofline)
    budget = (
        replica_load_budget(cost, link) if args.max_num_loaded_blocks is None else args.max_num_loaded_blocks
    )
    tier = f"tier {args.tier_gib:g} GiB"
    results = [
        simulate(workload, args.num_gpu_blocks, 0.0, cost, label="no tier"),
        simulate(workload, args.num_gpu_blocks, args.tier_gib, cost, label=f"{tier}, loads unbounded"),
        simulate(
            workload,
            args.num_gpu_blocks,
            args.tier_gib,
            cost,
            label=f"{tier}, <= {budget} loads/plan",
            max_num_loaded_blocks=budget,
        ),
    ]
    _print(results)
    base = results[0]
    for run in results[1:]:
        print(f"TTFT p50, no tier / {run.label}: {base.ttft_p50_ms / run.ttft_p50_ms:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
