"""Traffic from a request log (pagedserve.common.request_log): its statistics, and requests that
replay it.

A log carries no prompts, only their lengths and block-hash chains. `replay_requests` gives every
distinct chain prefix its own random block of token ids, so two synthesized prompts share exactly
the leading blocks whose hashes their logged chains share (equal hash prefixes, equal token
prefixes), and nothing else: the replay's prefix-cache hits are the original traffic's. Tokens
after the last full block are drawn fresh for each request. Each request asks for its logged output
length with EOS ignored, so it generates as many tokens as the original did.

Arrivals keep the log's spacing while requests overlapped; `time_scale` multiplies only the idle
gaps, when the log had no request in flight (0 removes them), so a day of traffic replays in its
busy minutes with the concurrency it really had.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.bench.workloads import BenchRequest, token_id_range
from pagedserve.common.request_log import RequestLogRecord


@dataclass(frozen=True)
class TrafficStats:
    """What `pagedserve plan --traffic` and `tune` report of a log.

    Attributes:
        block_reuse: the fraction of the prompts' full blocks whose hash an earlier request of the
            log already had: the prefix-cache hit rate an unbounded cache would reach (an upper bound).
        peak_concurrency: the most requests in flight at once (arrival to end of stream).
    """

    num_requests: int
    duration_s: float
    prompt_len_p50: int
    prompt_len_p99: int
    output_len_p50: int
    output_len_p99: int
    context_len_p50: int
    context_len_p99: int
    context_len_max: int
    peak_concurrency: int
    block_size: int
    block_reuse: float
    logged_cached_fraction: float  # cached prompt tokens / prompt tokens, as the server reported
    preemptions: int
    ttft_p50_s: float | None  # as the logging server measured them (None: no request got a token)
    ttft_p99_s: float | None


def _percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank percentile (a length that occurred, not an interpolation)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))
    return ordered[int(rank) - 1]


def peak_concurrency(records: Sequence[RequestLogRecord]) -> int:
    events = sorted([(r.arrival_time, 1) for r in records] + [(r.end_time, -1) for r in records])
    peak = running = 0
    for _, change in events:  # at equal times an end (-1) sorts first: it freed its slot
        running += change
        peak = max(peak, running)
    return peak


def block_reuse(records: Sequence[RequestLogRecord]) -> float:
    """See TrafficStats.block_reuse; `records` in arrival order."""
    seen: set[str] = set()
    total = reused = 0
    for record in records:
        for block_hash in record.block_hashes:
            total += 1
            reused += block_hash in seen
            seen.add(block_hash)
    return reused / total if total else 0.0


def traffic_stats(records: Sequence[RequestLogRecord]) -> TrafficStats:
    prompts = [r.prompt_len for r in records]
    outputs = [r.output_len for r in records]
    contexts = [r.prompt_len + r.output_len for r in records]
    start = min(r.arrival_time for r in records)
    end = max(r.end_time for r in records)
    prompt_tokens = sum(prompts)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    return TrafficStats(
        num_requests=len(records),
        duration_s=end - start,
        prompt_len_p50=_percentile(prompts, 50),
        prompt_len_p99=_percentile(prompts, 99),
        output_len_p50=_percentile(outputs, 50),
        output_len_p99=_percentile(outputs, 99),
        context_len_p50=_percentile(contexts, 50),
        context_len_p99=_percentile(contexts, 99),
        context_len_max=max(contexts),
        peak_concurrency=peak_concurrency(records),
        block_size=records[0].block_size,
        block_reuse=block_reuse(records),
        logged_cached_fraction=sum(r.cached_prompt_tokens for r in records) / prompt_tokens,
        preemptions=sum(r.num_preemptions for r in records),
        ttft_p50_s=_percentile(ttfts, 50) if ttfts else None,
        ttft_p99_s=_percentile(ttfts, 99) if ttfts else None,
    )


def replay_arrivals(records: Sequence[RequestLogRecord], time_scale: float = 1.0) -> list[float]:
    """Send offsets (seconds from the first arrival), one per record in arrival order, with the idle
    gaps multiplied by `time_scale` (see the module doc)."""
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    offsets: list[float] = []
    shift = 0.0  # how much earlier than logged the current request is sent
    busy_until = None  # the latest end of a request that arrived so far
    start = records[0].arrival_time if records else 0.0
    for record in records:
        if busy_until is not None and record.arrival_time > busy_until:
            shift += (1.0 - time_scale) * (record.arrival_time - busy_until)
        offsets.append(record.arrival_time - start - shift)
        busy_until = record.end_time if busy_until is None else max(busy_until, record.end_time)
    return offsets


def replay_requests(
    records: Sequence[RequestLogRecord], vocab_size: int, max_model_len: int | None = None, seed: int = 0
) -> list[BenchRequest]:
    """One request per record (in order), with prompts whose lengths and block sharing are the log's
    (see the module doc). Lengths are capped to `max_model_len` as `generate_requests` caps them."""
    rng = random.Random(f"{seed}:replay")
    lo, hi = token_id_range(vocab_size)
    blocks: dict[str, list[int]] = {}  # one token block per distinct chain prefix (its last hash)
    requests = []
    for index, record in enumerate(records):
        size = record.block_size
        prompt: list[int] = []
        for block_hash in record.block_hashes:
            if block_hash not in blocks:
                blocks[block_hash] = [rng.randrange(lo, hi) for _ in range(size)]
            prompt += blocks[block_hash]
        # Full blocks the chain does not name (a log written without them) and the partial tail.
        prompt += [rng.randrange(lo, hi) for _ in range(record.prompt_len - len(prompt))]
        output_len = max(1, record.output_len)
        if max_model_len is not None:
            prompt = prompt[: max_model_len - 1]
            output_len = max(1, min(output_len, max_model_len - len(prompt)))
        requests.append(BenchRequest(index, tuple(prompt), output_len))
    return requests


def sharing_signature(chains: Sequence[Sequence[str]]) -> list[tuple[int, ...]]:
    """Each chain with its hashes renamed by first appearance: two logs' signatures are equal exactly
    when their requests share the same prefixes, whatever the tokens (and so the hashes) are."""
    ids: dict[str, int] = {}
    return [tuple(ids.setdefault(h, len(ids)) for h in chain) for chain in chains]


def replay_fidelity(
    source: Sequence[RequestLogRecord],
    requests: Sequence[BenchRequest],
    replayed: dict[int, RequestLogRecord],
) -> dict:
    """How the replay (its requests, and its scheduler's log by request index) matched the log it
    replayed: prompt and output lengths, and prefix sharing (comparable when the block sizes agree)."""
    found = [i for i in range(len(source)) if i in replayed]
    prompts = sum(replayed[i].prompt_len == source[i].prompt_len for i in found)
    outputs = sum(replayed[i].output_len == source[i].output_len for i in found)
    sizes = {source[0].block_size} | {replayed[i].block_size for i in found}
    sharing = None
    if len(found) == len(source) and len(sizes) == 1:
        sharing = sharing_signature([source[i].block_hashes for i in found]) == sharing_signature(
            [replayed[i].block_hashes for i in found]
        )
    return {
        "requests": len(source),
        "logged": len(found),
        "prompt_lengths_equal": prompts == len(source),
        "output_lengths_equal": outputs == len(source),
        "sharing_equal": sharing,
        "capped_prompts": sum(len(r.prompt) < s.prompt_len for r, s in zip(requests, source, strict=True)),
    }
