"""Latency distributions, throughput and server-side figures of a pass."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pagedserve.bench.client import PassResult, ReadFloorInputs, RequestRecord

PERCENTILES = (50, 90, 99)
# SchedulerStats counters of the scheduling core (engine-level steps and tokens_generated survive
# an executor's loss; these restart from 0 with the core that a re-attach creates).
_CORE_COUNTERS = (
    "num_preemptions",
    "prompt_tokens_computed",
    "prefix_cache_hit_tokens",
    "prefix_cache_query_tokens",
    "peak_gpu_blocks_in_use",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_steps",
)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds (None when there are no values)."""
    import numpy as np

    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def throughput_timeline(records: Sequence[RequestRecord], start: float, bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive `bin_s` bins from the start of the pass."""
    bins: Counter[int] = Counter()
    last = 0
    for r in records:
        for t, k in zip(r.message_times, r.message_tokens, strict=True):
            b = int((t - start) // bin_s)
            bins[b] += k
            last = max(last, b)
    return [bins[b] / bin_s for b in range(last + 1)] if bins else []


def server_metrics(result: PassResult) -> dict | None:
    """Deltas of the scheduler's counters over the pass, and its peak KV use."""
    before, after = result.stats_before, result.stats_after
    if before is None or after is None:
        return None
    # The scheduling core's counters live as long as one executor attachment: when the executor
    # was lost during the pass (no pool now) or replaced (a counter went back), their deltas are
    # meaningless, even negative, so they are left out; the engine's steps and tokens go on.
    reset = after.num_gpu_blocks == 0 or any(getattr(after, n) < getattr(before, n) for n in _CORE_COUNTERS)

    def delta(name: str) -> int | None:
        return None if reset else getattr(after, name) - getattr(before, name)

    if not reset and after.peak_gpu_blocks_in_use > before.peak_gpu_blocks_in_use:  # it is ours
        peak, slot_util, source = after.peak_gpu_blocks_in_use, after.peak_slot_utilization, "server"
    else:
        peak, slot_util, source = result.sampled_peak_blocks, result.sampled_slot_utilization, "sampled"
    hits, queries = delta("prefix_cache_hit_tokens"), delta("prefix_cache_query_tokens")
    steps, tokens = after.steps - before.steps, after.tokens_generated - before.tokens_generated
    drafted, accepted, drafts = delta("spec_draft_tokens"), delta("spec_accepted_tokens"), delta("spec_steps")
    return {
        "counters_reset": reset,
        "preemptions": delta("num_preemptions"),
        "num_gpu_blocks": after.num_gpu_blocks or before.num_gpu_blocks,
        "peak_gpu_blocks_in_use": peak,
        "peak_slot_utilization": slot_util,
        "peak_source": source,
        "peak_running_requests": result.sampled_peak_running or None,  # sampled every 0.25 s
        "prompt_tokens_computed": delta("prompt_tokens_computed"),
        "prefix_cache_hit_tokens": hits,
        "prefix_cache_query_tokens": queries,
        "prefix_cache_hit_rate": hits / queries if queries else None,  # None: not reported or reset
        "steps": steps,
        "tokens_generated": tokens,
        # Executor steps per token streamed: 1 / the batch without speculation, lower with it.
        "steps_per_output_token": steps / tokens if tokens else None,
        # Speculative decoding (None without proposals): accepted / proposed tokens, and the mean
        # tokens a verification emits (its accepted proposals and the one sampled after them).
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / drafted if drafted and accepted is not None else None,
        "spec_mean_accepted_length": 1 + accepted / drafts if drafts and accepted is not None else None,
        # The scheduler's CPU per executor step: what decides when a scheduler needs a second one.
        "scheduler_cpu_ms_per_step": (
            1000 * (after.process_cpu_seconds - before.process_cpu_seconds) / (after.steps - before.steps)
            if after.steps > before.steps and after.process_cpu_seconds
            else None
        ),
    }


def read_floor(records: Sequence[RequestRecord], inputs: ReadFloorInputs | None) -> dict | None:
    """The least time a decode step of this pass could take: the bytes it must read (every weight
    once, and the KV of every running sequence's context) over the measured copy bandwidth.

    The batch and the context come from what the client saw: the decode batch is the mean number
    of requests between their first and last token over the decode phase (divided among the
    executors), and the context of a decoding request grows from its prompt to prompt + output,
    so its mean is prompt + output / 2 (weighted by how long each request decoded). A step of that
    batch reads weight_read_bytes + batch * context * kv_bytes_per_token. Per-token latency
    (ITL, TPOT) is a step's time, so it is compared with this floor directly. None when the
    executors reported no copy bandwidth (off CUDA) or nothing decoded.
    """
    if inputs is None or inputs.copy_bytes_per_s <= 0:
        return None
    spans = [
        (r.message_times[0], r.message_times[-1], r.prompt_len + r.num_output / 2)
        for r in records
        if r.ok and len(r.message_times) > 1
    ]
    busy = sum(end - first for first, end, _ in spans)
    if busy <= 0:
        return None
    window = max(end for _, end, _ in spans) - min(first for first, _, _ in spans)
    batch = busy / window / max(inputs.num_executors, 1)
    context = sum((end - first) * ctx for first, end, ctx in spans) / busy
    kv_bytes = batch * context * inputs.kv_bytes_per_token
    return {
        "decode_batch": batch,
        "mean_context_tokens": context,
        "weight_read_bytes": inputs.weight_read_bytes,
        "kv_read_bytes": kv_bytes,
        "copy_bytes_per_s": inputs.copy_bytes_per_s,
        "floor_ms": 1000 * (inputs.weight_read_bytes + kv_bytes) / inputs.copy_bytes_per_s,
    }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(result: PassResult) -> dict:
    """Every metric of a pass, JSON-ready, with per-request records."""
    records = result.records
    ok = [r for r in records if r.ok]
    duration = max(result.end - result.start, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.num_output for r in ok)
    cached_tokens = sum(r.cached_prompt_tokens for r in ok)
    errors = Counter(r.error.split(":", 1)[0] for r in records if not r.ok)
    tpot, itl = (
        distribution([r.tpot for r in ok if r.tpot is not None]),
        distribution([x for r in ok for x in r.itls()]),
    )
    floor = read_floor(records, result.floor_inputs)
    if floor is not None:  # per-token latency over the floor: 1.0 would be reading at copy speed
        for name, value in (("itl_p50", itl["p50"]), ("itl_p99", itl["p99"]), ("tpot_mean", tpot["mean"])):
            floor[f"{name}_over_floor"] = None if value is None else value / floor["floor_ms"]
    return {
        "label": result.label,
        "request_rate": "inf" if math.isinf(result.request_rate) else result.request_rate,
        "prefix_caching": result.prefix_caching,
        "seed": result.seed,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(errors),
        "error_examples": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": cached_tokens,  # Usage.cached_prompt_tokens, summed
        "cached_prompt_fraction": cached_tokens / input_tokens if input_tokens else 0.0,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        # Each request's own decode rate (tokens after the first over the time after the first),
        # averaged: what speculative decoding speeds up.
        "output_tps_per_request": _mean(
            [(r.num_output - 1) / (r.e2e - r.ttft) for r in ok if r.ttft is not None and r.e2e > r.ttft]
        ),
        # Messages per token of each request, averaged: with the server's --stream-interval 1, the
        # steps it sampled in per token (an accepted run of proposals is one message).
        "messages_per_output_token": _mean(
            [len(r.message_tokens) / r.num_output for r in ok if r.num_output]
        ),
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "max_concurrency": result.max_concurrency,
        "tpot_ms": tpot,
        "itl_ms": itl,
        "read_floor": floor,
        "e2e_ms": distribution([r.e2e for r in ok]),
        "server": server_metrics(result),
        "throughput_timeline": throughput_timeline(records, result.start),
        "requests": [
            {
                "index": r.index,
                "prompt_len": r.prompt_len,
                "max_tokens": r.max_tokens,
                "output_tokens": r.num_output,
                "cached_prompt_tokens": r.cached_prompt_tokens,
                "start_s": r.start - result.start,
                "ttft_ms": None if r.ttft is None else r.ttft * 1000,
                "e2e_ms": r.e2e * 1000,
                "finish_reason": r.finish_reason,
                "error": r.error or None,
            }
            for r in records
        ],
    }


def compare_outputs(a: PassResult, b: PassResult) -> dict:
    """Whether two passes over the same requests produced the same tokens (greedy: they must)."""
    tokens_b = {r.index: r.token_ids for r in b.records if r.ok}
    both = [r for r in a.records if r.ok and r.index in tokens_b]
    differing = [r.index for r in both if r.token_ids != tokens_b[r.index]]
    return {"compared": len(both), "identical": not differing and bool(both), "differing": differing[:20]}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The position of the first token where `a` and `b` differ (a length counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def output_matches(a: PassResult, b: PassResult) -> dict[int, int | None]:
    """Request by request (index: first differing token, None when the outputs are equal), for the
    requests that completed in both passes. Greedy decoding in bf16 can still flip a near-tie when
    batching differs, from that token on; in float32 every request must match."""
    tokens_b = {r.index: r.token_ids for r in b.records if r.ok}
    return {
        r.index: first_difference(r.token_ids, tokens_b[r.index])
        for r in a.records
        if r.ok and r.index in tokens_b
    }
