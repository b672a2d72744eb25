"""Per-step timing of the executor (`--step-trace FILE`), to see where a workload's time goes.

A benchmark's total says how fast; it does not say whether the time went into prefill, into
decode steps of a small batch at the end of the run, or into the GPU waiting for the host. With a
trace, each step appends one JSON line: its shape (tokens, sequences, decode tokens, KV tokens it
attends over), the KV blocks it moved to or from host memory (the CPU tier's loads and offloads on
the copy stream beside its forward, swaps on the forward's stream before it), whether it replayed a
CUDA graph, the host time its launch took, and from CUDA events recorded in stream order around it,
the GPU time from its first kernel to its sampled tokens (`gpu_ms`) and how long the GPU sat idle
before it (`gap_ms`): waiting for the plan, for the host to prepare the step's inputs, for the tier
copies queued beside the step before, or for its own swaps. Host timestamps (ms since the trace
began) place each step's launch, its plan's arrival and its output: from them the summary says how
long a step's output takes to turn into the next step's launch and plan (the host's round trip,
which a verification step waits for).

    python -m pagedserve.executor.step_trace FILE      # by kind of step and by decode batch size

Kinds: decode (one token per sequence), verify (sequences verifying proposals, maybe beside
one-token decodes), prefill, mixed (prefill chunks beside decodes or verifications), empty. Each
row gives totals and medians per step.

Off by default: an event pair and a line of JSON per step cost a few microseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TextIO

import torch

from pagedserve.common.tables import markdown_table
from pagedserve.executor.step_inputs import HostBatch


@dataclass(slots=True)
class StepRecord:
    """One step, as written to the trace."""

    step_id: int
    tokens: int = 0
    seqs: int = 0
    decodes: int = 0  # sequences with exactly one new token
    verified: int = 0  # sequences verifying proposals (speculative decoding)
    kv_tokens: int = 0  # sum of the sequences' context lengths: what attention reads
    copied_beside: int = 0  # CPU-tier blocks loaded or offloaded on the copy stream beside the forward
    swapped: int = 0  # blocks swapped out or in before the forward, on its stream
    graph: bool = False
    ahead: bool = False  # launched before its plan arrived (ModelRunner.launch_ahead)
    launch_ms: float = 0.0  # host time in ModelRunner.launch
    launched_at_ms: float = 0.0  # host clock (ms since the trace began): its launch began
    plan_at_ms: float = 0.0  # its plan reached the runner (after the launch, for a step launched ahead)
    output_at_ms: float = 0.0  # its output was ready to send
    gpu_ms: float | None = None  # its first kernel to its sampled tokens (CUDA only)
    gap_ms: float | None = None  # GPU idle between the previous step's end and this one's start
    _t0: float = field(default=0.0, repr=False)
    _start: torch.cuda.Event | None = field(default=None, repr=False)
    _end: torch.cuda.Event | None = field(default=None, repr=False)

    @property
    def kind(self) -> str:
        if self.tokens == 0:
            return "empty"
        if self.verified:  # verifications, maybe beside one-token decodes
            return "verify" if self.decodes + self.verified == self.seqs else "mixed"
        if self.decodes == self.tokens:
            return "decode"
        return "mixed" if self.decodes else "prefill"


class StepTracer:
    """Owns the trace file and the previous step's end event (for the gap)."""

    def __init__(self, path: str | Path, device: torch.device) -> None:
        self._out: TextIO = open(path, "w", buffering=1)  # noqa: SIM115 - line-buffered, kept open
        self._cuda = device.type == "cuda"
        self._prev_end: torch.cuda.Event | None = None
        self._origin = time.perf_counter()

    def now_ms(self) -> float:
        """The host clock of the trace: ms since it began."""
        return 1000 * (time.perf_counter() - self._origin)

    def begin(self, step_id: int, copied_beside: int = 0, swapped: int = 0) -> StepRecord:
        t0 = time.perf_counter()
        at = 1000 * (t0 - self._origin)
        return StepRecord(
            step_id, copied_beside=copied_beside, swapped=swapped, launched_at_ms=at, plan_at_ms=at, _t0=t0
        )

    def forward_starts(self, record: StepRecord, batch: HostBatch, graph: bool, verified: int = 0) -> None:
        """Records the step's shape (`verified`: its sequences that verify proposals), and its
        start event just before its first kernel is queued (the host has prepared the inputs by
        then, so waiting for that counts as idle)."""
        q_lens = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
        record.tokens = int(batch.cu_seqlens[-1])
        record.seqs = len(batch.rows)
        record.decodes = int((q_lens == 1).sum())
        record.verified = verified
        record.kv_tokens = int(batch.seq_lens.sum())
        record.graph = graph
        if self._cuda:
            record._start = torch.cuda.Event(enable_timing=True)
            record._start.record()

    def launched(self, record: StepRecord) -> None:
        record.launch_ms = 1000 * (time.perf_counter() - record._t0)
        if record._start is not None:
            record._end = torch.cuda.Event(enable_timing=True)
            record._end.record()

    def finished(self, record: StepRecord) -> None:
        """Called once the step's outputs are in; writes its line."""
        record.output_at_ms = self.now_ms()
        if record._start is not None and record._end is not None:
            record._end.synchronize()
            record.gpu_ms = record._start.elapsed_time(record._end)
            if self._prev_end is not None:
                record.gap_ms = max(0.0, self._prev_end.elapsed_time(record._start))
            self._prev_end = record._end
        # Not dataclasses.asdict: it would deep-copy the CUDA events, which cannot be copied.
        line = {f.name: getattr(record, f.name) for f in fields(record) if not f.name.startswith("_")}
        self._out.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._out.close()


def load(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(records: list[dict]) -> str:
    """A markdown table per kind of step, and decode steps by batch size bucket."""

    def kind(r: dict) -> str:
        return StepRecord(0, r["tokens"], r["seqs"], r["decodes"], r.get("verified", 0)).kind

    def bucket(r: dict) -> str:
        if kind(r) != "decode":
            return kind(r)
        low = 1 << (r["seqs"].bit_length() - 1)
        return f"decode {low}-{2 * low - 1}"

    def table(title: str, key) -> list[str]:
        groups: dict[str, list[dict]] = defaultdict(list)
        for r in records:
            groups[key(r)].append(r)
        header = (
            "steps, n, tokens, decode tok, KV tok/seq, GPU s, gap s, launch s, GPU µs/token, "
            "GPU ms p50, gap ms p50, launch ms p50"
        ).split(", ")
        rows = []
        for name in sorted(groups, key=lambda g: -sum(r["gpu_ms"] or 0 for r in groups[g])):
            rs = groups[name]
            tokens = sum(r["tokens"] for r in rs)
            gpu = sum(r["gpu_ms"] or 0 for r in rs) / 1000
            gap = sum(r["gap_ms"] or 0 for r in rs) / 1000
            launch = sum(r["launch_ms"] for r in rs) / 1000
            kv_per_seq = sum(r["kv_tokens"] for r in rs) / max(sum(r["seqs"] for r in rs), 1)
            decodes = sum(r["decodes"] for r in rs)
            times = [f"{seconds:.2f}" for seconds in (gpu, gap, launch)]
            per_token = f"{1e6 * gpu / max(tokens, 1):.1f}"
            medians = [_median(r.get(field) for r in rs) for field in ("gpu_ms", "gap_ms", "launch_ms")]
            rows.append([name, len(rs), tokens, decodes, f"{kv_per_seq:.0f}", *times, per_token, *medians])
        return [f"\n{title}", markdown_table(header, rows)]

    def copies(r: dict) -> str:
        """A step's forward shares the host link and SMs with the tier copies beside it, and the
        next step waits for them (executor.kv_cache); swaps run before the forward, on its stream."""
        parts = [kind(r)]
        if r.get("copied_beside"):
            parts.append("copies beside")
        if waits_for_copies.get(r["step_id"]):
            parts.append("waits for copies")
        if r.get("swapped"):
            parts.append("swaps")
        return ", ".join(parts)

    waits_for_copies = {r["step_id"] + 1: r.get("copied_beside", 0) for r in records}
    lines = table("by kind", kind) + table("by kind, decode steps by batch size", bucket)
    if any(r.get("copied_beside") or r.get("swapped") for r in records):
        lines += table("by kind and host copies", copies)
    lines += _round_trips(records)
    gpu = sum(r["gpu_ms"] or 0 for r in records) / 1000
    gap = sum(r["gap_ms"] or 0 for r in records) / 1000
    lines.append(f"\n{len(records)} steps: GPU {gpu:.2f} s, idle between steps {gap:.2f} s")
    return "\n".join(lines)


def _median(values) -> str:
    """The median of the values that are there (a CPU trace has no GPU times): "-" if none."""
    present = [v for v in values if v is not None]
    return f"{statistics.median(present):.3f}" if present else "-"


def _round_trips(records: list[dict]) -> list[str]:
    """Medians, over each step and the one before it, of the host time from the earlier step's
    output to the later one's launch and to its plan, by how the later one was launched. Negative:
    it came before the output (planned or launched ahead)."""
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for before, after in zip(records, records[1:], strict=False):
        if "output_at_ms" not in before:
            return []  # a trace of an older build
        name = "launched ahead" if after.get("ahead") else "launched on its plan"
        out = before["output_at_ms"]
        groups[name].append((after["launched_at_ms"] - out, after["plan_at_ms"] - out))
    rows = []
    for name, pairs in sorted(groups.items()):
        launch, plan = (statistics.median(column) for column in zip(*pairs, strict=True))
        rows.append([name, len(pairs), f"{launch:.3f}", f"{plan:.3f}"])
    header = ["steps", "n", "output -> its launch (ms)", "output -> its plan (ms)"]
    return ["\nhost round trip from the step before's output (medians)", markdown_table(header, rows)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Sums up an executor step trace (--step-trace).")
    parser.add_argument("trace", type=Path)
    args = parser.parse_args(argv)
    print(summarize(load(args.trace)))


if __name__ == "__main__":
    main()
