"""The scheduler's cost of structured outputs: time to fill the next-token masks per plan, with N
running constrained requests (W1-JSON's schema), driven one plan in flight ahead as the replica's
step loop drives the core.

Each request holds a real xgrammar matcher for `W1_JSON_SCHEMA` on the model's tokenizer; the
"executor" answers each plan at once with a token drawn uniformly from each row's mask (so the
matchers walk through the whole grammar: numbers, the enum, the long string). Measured: the time
`Scheduler._fill_masks` takes per plan (p50, p99, per row), and schedule() as a whole. Runs on the
CPU (it is scheduler work); on the GPU host it measures that host's CPU.

    python -m benchmarks.structured_masks --model DIR --requests 512 --steps 200 --result-file masks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque
from pathlib import Path

import numpy as np

from pagedserve.bench.workloads import W1_JSON_SCHEMA
from pagedserve.common.tables import render_table
from pagedserve.common.validation import validate_request
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.core import Scheduler
from pagedserve.scheduler.request import Request, SamplingOptions, SeqId
from pagedserve.scheduler.structured import GrammarCompilerPool

PLANS_IN_FLIGHT = 2  # as scheduler/replica.py


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pool = GrammarCompilerPool(tokenizer, vocab, eos)
    spec = validate_request(
        {"prompt": "x", "structured_outputs": {"json": W1_JSON_SCHEMA}}
    ).structured_outputs
    start = time.perf_counter()
    pool.grammar_blocking(spec)
    compile_s = time.perf_counter() - start
    n, block_size = args.requests, 16
    max_len = args.prompt_len + args.steps + 8
    core = Scheduler(
        SchedulerConfig(
            block_size=block_size,
            num_gpu_blocks=n * (-(-max_len // block_size)) + 8,
            max_model_len=max_len,
            max_num_seqs=n,
            max_num_batched_tokens=max(8192, n * args.prompt_len),
            enable_prefix_caching=False,
        )
    )
    rng = np.random.default_rng(0)
    for i in range(n):
        prompt = rng.integers(0, vocab, args.prompt_len).tolist()
        core.add_request(
            Request(SeqId(i + 1), prompt, args.steps, SamplingOptions(), grammar=pool.grammar_blocking(spec))
        )
    in_flight: deque = deque()
    schedule_s: list[float] = []
    rows: list[int] = []
    for _ in range(args.steps + PLANS_IN_FLIGHT):
        t0 = time.perf_counter()
        plan = core.schedule()
        schedule_s.append(time.perf_counter() - t0)
        rows.append(len(plan.masked_seq_ids))
        in_flight.append(plan)
        if len(in_flight) >= PLANS_IN_FLIGHT or plan.is_empty:
            done = in_flight.popleft()
            tokens = []
            masks = done.token_bitmask
            index = {s: r for r, s in enumerate(done.masked_seq_ids)}
            for seq_id in done.sampling_seq_ids:
                bits = np.unpackbits(masks[index[seq_id]].view(np.uint8), bitorder="little")[:vocab]
                tokens.append(int(rng.choice(np.flatnonzero(bits))))
            for request in core.process_output(done.step_id, list(done.sampling_seq_ids), tokens):
                if request.grammar is not None and request.grammar.is_terminated:
                    core.abort_request(request.seq_id)
        if not core.has_unfinished_requests():
            break
    masks_ms = [s * 1e3 for s in core.mask_seconds[args.warmup :]]
    masked_rows = [r for r in rows if r][args.warmup :]
    pool.close()
    return {
        "model": str(args.model),
        "vocab_size": vocab,
        "requests": n,
        "plans": len(masks_ms),
        "compile_s": round(compile_s, 4),
        "rows_per_plan_mean": round(statistics.mean(masked_rows), 1) if masked_rows else 0,
        "mask_ms_p50": round(_percentile(masks_ms, 0.5), 3),
        "mask_ms_p99": round(_percentile(masks_ms, 0.99), 3),
        "mask_us_per_row_p50": round(
            statistics.median(m * 1e3 / r for m, r in zip(masks_ms, masked_rows, strict=False)), 2
        ),
        "schedule_ms_p50": round(_percentile([s * 1e3 for s in schedule_s], 0.5), 3),
        "schedule_ms_p99": round(_percentile([s * 1e3 for s in schedule_s], 0.99), 3),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.structured_masks", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--model", default=None, help="a model directory (its tokenizer and vocab); default: built-in"
    )
    p.add_argument("--requests", type=int, default=512, help="running constrained requests")
    p.add_argument("--steps", type=int, default=200, help="decode steps (tokens each request may sample)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--warmup", type=int, default=4, help="plans with masks left out of the figures")
    p.add_argument("--result-file", type=Path, default=None, help="write the figures as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None:
        from pagedserve.common.default_model import resolve_model

        args.model = resolve_model(None)
    result = run(args)
    rows = [[k, str(v)] for k, v in result.items()]
    print(render_table("structured outputs: the scheduler's mask time per plan", ["figure", "value"], rows))
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
