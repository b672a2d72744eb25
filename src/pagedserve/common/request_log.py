"""The request log's format: one JSON object per line, one line per finished request.

The scheduler writes it (`--request-log FILE`, scheduler.request_log); `pagedserve plan --traffic`
and `pagedserve tune --traffic` read it. A line holds what a replay needs and no text: when the
request arrived, its prompt and output lengths, priority, how it ended, its time to first token,
and the prompt's **block-hash chain**, the hex of the scheduler's own `hash_block_tokens` chain
over the prompt's full blocks (cut to `HASH_BYTES`). Two requests whose chains start with the same
k hashes share their first k blocks of tokens, so the chains say how much of the traffic a prefix
cache could serve, and let `tune` synthesize token ids with the same sharing, without the prompts.
The text is only there with `--request-log-text`.

The hashes are not salted: someone who has a candidate prompt can test whether a log's prompts
begin with it. Keep a log as private as the traffic's prefixes; drop the chains if that matters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

# Bytes of each block hash written (of blake2b's 32): 16 bytes tell blocks apart until ~2^64 of
# them, at half the size of a line.
HASH_BYTES = 16
FORMAT_VERSION = 1


class RequestLogError(ValueError):
    """A request log that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class RequestLogRecord:
    """One finished request.

    Attributes:
        request_id: the client's request id (or the scheduler's uuid).
        arrival_time: Unix time (seconds) the request reached the scheduler.
        prompt_len, output_len: prompt tokens, and tokens generated.
        priority: the request's priority (lower runs sooner).
        finish_reason: "stop", "length" or "abort" (client gone, deadline, shutdown).
        ttft_s: seconds from arrival to the first token sent; None when none was.
        e2e_s: seconds from arrival to the end of the stream.
        cached_prompt_tokens: prompt tokens the prefix cache served.
        num_preemptions: times the request was pre-empted.
        block_size: tokens per block of the chain.
        block_hashes: hex hash of each full block of the prompt, chained from the first.
        prompt_text, output_text: only with --request-log-text.
    """

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    priority: int
    finish_reason: str
    ttft_s: float | None
    e2e_s: float
    cached_prompt_tokens: int
    num_preemptions: int
    block_size: int
    block_hashes: tuple[str, ...] = field(default=())
    prompt_text: str | None = None
    output_text: str | None = None

    def to_json(self) -> str:
        data = asdict(self)
        data["block_hashes"] = list(self.block_hashes)
        for key in ("prompt_text", "output_text"):
            if data[key] is None:
                del data[key]
        return json.dumps({"v": FORMAT_VERSION, **data}, separators=(",", ":"), ensure_ascii=False)

    @property
    def end_time(self) -> float:
        return self.arrival_time + self.e2e_s


_REQUIRED = [f.name for f in fields(RequestLogRecord) if f.name not in ("prompt_text", "output_text")]


def _record(data: object, where: str) -> RequestLogRecord:
    if not isinstance(data, dict):
        raise RequestLogError(f"{where}: expected a JSON object, got {type(data).__name__}")
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise RequestLogError(f"{where}: missing {', '.join(missing)} (is this a pagedserve request log?)")

    def number(name: str, minimum: float, integer: bool = False, optional: bool = False):
        value = data[name]
        if value is None and optional:
            return None
        ok = isinstance(value, int) if integer else isinstance(value, int | float)
        if isinstance(value, bool) or not ok or not math.isfinite(value) or value < minimum:
            kind = "an integer" if integer else "a number"
            raise RequestLogError(f"{where}: {name} must be {kind} >= {minimum}, got {value!r}")
        return value

    hashes = data["block_hashes"]
    if not isinstance(hashes, list) or not all(isinstance(h, str) and h for h in hashes):
        raise RequestLogError(f"{where}: block_hashes must be a list of hex strings")
    block_size = number("block_size", 1, integer=True)
    prompt_len = number("prompt_len", 1, integer=True)
    if len(hashes) > prompt_len // block_size:
        raise RequestLogError(
            f"{where}: {len(hashes)} block hashes for a prompt of {prompt_len} tokens in blocks of "
            f"{block_size}"
        )
    for name in ("request_id", "finish_reason"):
        if not isinstance(data[name], str):
            raise RequestLogError(f"{where}: {name} must be a string, got {data[name]!r}")
    return RequestLogRecord(
        request_id=data["request_id"],
        arrival_time=float(number("arrival_time", 0)),
        prompt_len=prompt_len,
        output_len=number("output_len", 0, integer=True),
        priority=number("priority", -(2**63), integer=True),
        finish_reason=data["finish_reason"],
        ttft_s=number("ttft_s", 0, optional=True),
        e2e_s=float(number("e2e_s", 0)),
        cached_prompt_tokens=number("cached_prompt_tokens", 0, integer=True),
        num_preemptions=number("num_preemptions", 0, integer=True),
        block_size=block_size,
        block_hashes=tuple(hashes),
        prompt_text=data.get("prompt_text"),
        output_text=data.get("output_text"),
    )


def parse_lines(lines: Iterable[str], name: str = "<log>") -> Iterator[RequestLogRecord]:
    """Records of a log's lines; blank lines are skipped, anything else malformed is an error."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestLogError(f"{where}: not JSON ({exc.msg})") from None
        yield _record(data, where)


def read_request_log(path: str | Path) -> list[RequestLogRecord]:
    """Every record of the log at `path`, in arrival order (the scheduler writes them as requests
    finish). Raises RequestLogError for an unreadable, empty or malformed log."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            records = list(parse_lines(f, str(path)))
    except OSError as exc:
        raise RequestLogError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise RequestLogError(f"{path} is not UTF-8 text (is it a request log?)") from None
    if not records:
        raise RequestLogError(f"{path} holds no requests")
    sizes = {r.block_size for r in records}
    if len(sizes) > 1:  # chains of different block sizes cannot be compared
        raise RequestLogError(f"{path} mixes block sizes {sorted(sizes)}: one log per block size")
    return sorted(records, key=lambda r: r.arrival_time)
