"""The request log: the scheduler's writer (hashes off the event loop, text only when asked), the
reader's errors, the traffic statistics, and replays that keep a log's lengths, prefix sharing and
arrivals. The log's round trip through launched services and `pagedserve tune` is in test_tune.py."""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.bench.replay import (
    block_reuse,
    peak_concurrency,
    replay_arrivals,
    replay_requests,
    sharing_signature,
    traffic_stats,
)
from pagedserve.common.request_log import HASH_BYTES, RequestLogError, RequestLogRecord, read_request_log
from pagedserve.scheduler.request_log import RequestLog, block_hash_chain


def record(index: int, arrival: float, prompt_len: int, output_len: int, hashes, e2e: float = 0.5, **kw):
    values = dict(
        request_id=f"r-{index}",
        arrival_time=arrival,
        prompt_len=prompt_len,
        output_len=output_len,
        priority=0,
        finish_reason="length",
        ttft_s=0.01,
        e2e_s=e2e,
        cached_prompt_tokens=0,
        num_preemptions=0,
        block_size=16,
        block_hashes=tuple(hashes),
    )
    return RequestLogRecord(**{**values, **kw})


class Tokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_the_writer_hashes_full_blocks_with_the_prefix_caches_chain(tmp_path):
    path = tmp_path / "log.jsonl"
    prompt = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens
    log = RequestLog(path, Tokenizer(), include_text=False, flush_interval=60)
    log.record(record(0, 1000.0, len(prompt), 7, ()), prompt, "output text")
    assert not path.read_text()  # nothing is written on the caller's thread
    log.close()
    (line,) = path.read_text().splitlines()
    data = json.loads(line)
    assert data["v"] == 1 and data["prompt_len"] == 50 and data["output_len"] == 7
    assert data["block_hashes"] == [h[:HASH_BYTES].hex() for h in block_hash_chain(prompt, 16)]
    assert len(data["block_hashes"]) == 3 and "prompt_text" not in data and "output_text" not in data

    # Appending, and the text only with --request-log-text.
    log = RequestLog(path, Tokenizer(), include_text=True, flush_interval=0.01)
    log.record(record(1, 1001.0, 3, 1, ()), [5, 6, 7], "out")
    log.close()
    first, second = read_request_log(path)
    assert first.block_hashes == tuple(data["block_hashes"])
    assert (second.prompt_text, second.output_text, second.block_hashes) == ("5 6 7", "out", ())


def test_the_chain_says_which_prefixes_are_shared():
    a = block_hash_chain([1] * 32 + [2] * 16, 16)
    b = block_hash_chain([1] * 32 + [3] * 16, 16)
    c = block_hash_chain([1] * 16 + [3] * 32, 16)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert c[0] == a[0] and c[1] != a[1] and c[2] != b[2]  # equal blocks after a difference differ


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json\n", ":1: not JSON"),
        ('["a list"]\n', ":1: expected a JSON object"),
        ('{"v": 1}\n', ":1: missing request_id"),
        ("", "holds no requests"),
    ],
)
def test_malformed_logs_name_the_line(tmp_path, content, message):
    path = tmp_path / "log.jsonl"
    path.write_text(content)
    with pytest.raises(RequestLogError, match=message):
        read_request_log(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompt_len": 0}, "prompt_len must be an integer >= 1"),
        ({"output_len": -1}, "output_len must be an integer >= 0"),
        ({"arrival_time": "noon"}, "arrival_time must be a number"),
        ({"block_hashes": "abc"}, "block_hashes must be a list"),
        ({"prompt_len": 20}, "2 block hashes for a prompt of 20 tokens"),
        ({"ttft_s": True}, "ttft_s must be a number"),
    ],
)
def test_bad_fields_are_named(tmp_path, change, message):
    good = json.loads(record(0, 1.0, 40, 4, ["aa", "bb"]).to_json())
    path = tmp_path / "log.jsonl"
    path.write_text("\n" + json.dumps({**good, **change}) + "\n")
    with pytest.raises(RequestLogError, match=f":2: {message}"):
        read_request_log(path)


def test_a_log_mixing_block_sizes_is_refused(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(
        record(0, 1.0, 40, 4, []).to_json() + "\n" + record(1, 2.0, 40, 4, [], block_size=32).to_json()
    )
    with pytest.raises(RequestLogError, match="mixes block sizes"):
        read_request_log(path)


def test_traffic_statistics():
    records = [
        record(0, 0.0, 100, 10, ["a", "b"], e2e=2.0),
        record(1, 1.0, 100, 10, ["a", "c"], e2e=2.0),  # overlaps the first
        record(2, 5.0, 40, 60, ["d"], e2e=1.0),
    ]
    assert peak_concurrency(records) == 2
    assert block_reuse(records) == pytest.approx(1 / 5)
    stats = traffic_stats(records)
    assert (stats.num_requests, stats.context_len_max, stats.context_len_p50, stats.duration_s) == (
        3,
        110,
        110,
        6.0,
    )


def test_replays_reproduce_lengths_and_exactly_the_logged_sharing():
    rng = random.Random(0)
    prefixes = [[f"{p}-{b}" for b in range(rng.randint(1, 6))] for p in range(4)]
    records = []
    for i in range(40):
        chain = list(prefixes[i % 4][: rng.randint(0, len(prefixes[i % 4]))])
        chain += [f"own-{i}-{b}" for b in range(rng.randint(0, 3))]
        prompt_len = 16 * len(chain) + rng.randint(0 if chain else 1, 15)
        records.append(record(i, float(i), prompt_len, rng.randint(1, 30), chain))
    requests = replay_requests(records, vocab_size=512, seed=3)
    assert [len(r.prompt) for r in requests] == [r.prompt_len for r in records]
    assert [r.output_len for r in requests] == [r.output_len for r in records]
    assert all(0 < t < 512 for r in requests for t in r.prompt)
    # Re-hash the synthesized prompts as the scheduler would: the same sharing, block for block.
    rehashed = [[h.hex() for h in block_hash_chain(list(r.prompt), 16)] for r in requests]
    assert sharing_signature(rehashed) == sharing_signature([r.block_hashes for r in records])
    capped = replay_requests(records, vocab_size=512, max_model_len=40, seed=3)
    assert all(len(r.prompt) + r.output_len <= 40 for r in capped)


def test_time_scale_compresses_only_the_idle_gaps():
    records = [
        record(0, 100.0, 8, 1, [], e2e=2.0),  # busy until 102
        record(1, 101.0, 8, 1, [], e2e=3.0),  # overlaps: keeps its offset; busy until 104
        record(2, 110.0, 8, 1, [], e2e=1.0),  # after 6 s idle
        record(3, 110.5, 8, 1, [], e2e=1.0),
    ]
    assert replay_arrivals(records) == [0.0, 1.0, 10.0, 10.5]
    assert replay_arrivals(records, 0.5) == pytest.approx([0.0, 1.0, 7.0, 7.5])
    assert replay_arrivals(records, 0.0) == pytest.approx([0.0, 1.0, 4.0, 4.5])


def test_the_text_needs_the_log():
    from pagedserve.scheduler.service_config import ServiceConfig

    with pytest.raises(ValueError, match="request_log_text needs request_log"):
        ServiceConfig(model="m", request_log_text=True)
