"""`--request-log FILE`: one JSON line per finished request (format: pagedserve.common.request_log).

The log is written off the hot path. `RequestLog.record` runs on the event loop when a stream ends
and only appends the request's figures and a reference to its prompt ids to a deque (no hashing, no
JSON, no I/O); a writer thread wakes every `flush_interval` seconds, hashes each prompt's full
blocks with the prefix cache's own `hash_block_tokens`, encodes the lines and appends them to the
file with one write and a flush. `close()` (at shutdown) writes what is left. A disk that stalls
stalls only that thread; records pile up in memory meanwhile (about 100 bytes and a prompt each).

The file is opened for appending, so a restarted scheduler adds to the same log.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from pagedserve.common.request_log import HASH_BYTES, RequestLogRecord
from pagedserve.scheduler.block_pool import BlockHash, hash_block_tokens

log = structlog.get_logger(__name__)

FLUSH_INTERVAL_S = 1.0


def block_hash_chain(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hash chain of every full block of `token_ids` (the prefix cache's chain: block i's hash
    covers tokens [0, (i + 1) * block_size))."""
    hashes: list[BlockHash] = []
    for index in range(len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[index * block_size : (index + 1) * block_size]))
    return hashes


@dataclass(frozen=True, slots=True)
class _Pending:
    """A finished request waiting for the writer thread: its record without the hashes and text."""

    record: RequestLogRecord
    prompt_token_ids: Sequence[int]
    output_text: str | None


class RequestLog:
    """Appends one line per finished request to `path`, from a thread of its own.

    Args:
        path: the log file (opened for appending now, so a bad path fails at startup).
        tokenizer: decodes prompts for `include_text`.
        include_text: also write prompt_text and output_text (--request-log-text).
        flush_interval: seconds between the writer's rounds.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any = None,
        include_text: bool = False,
        flush_interval: float = FLUSH_INTERVAL_S,
    ) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")
        self._tokenizer = tokenizer
        self.include_text = include_text
        self._flush_interval = flush_interval
        self._pending: collections.deque[_Pending] = collections.deque()
        self._stop = threading.Event()
        self.num_written = 0
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    def record(
        self,
        record: RequestLogRecord,
        prompt_token_ids: Sequence[int],
        output_text: str | None = None,
    ) -> None:
        """Queues a finished request (`record` without hashes; they are computed by the writer from
        `prompt_token_ids`, which must not change afterwards). Never blocks."""
        self._pending.append(_Pending(record, prompt_token_ids, output_text))

    def _line(self, item: _Pending) -> str:
        record = item.record
        hashes = block_hash_chain(item.prompt_token_ids, record.block_size)
        chain = tuple(h[:HASH_BYTES].hex() for h in hashes)
        text: dict[str, str | None] = {}
        if self.include_text:
            prompt = self._tokenizer.decode(list(item.prompt_token_ids)) if self._tokenizer else None
            text = {"prompt_text": prompt, "output_text": item.output_text}
        return dataclasses.replace(record, block_hashes=chain, **text).to_json()

    def _write_pending(self) -> None:
        lines = []
        while self._pending:
            lines.append(self._line(self._pending.popleft()))
        if lines:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
            self.num_written += len(lines)

    def _run(self) -> None:
        while not self._stop.wait(self._flush_interval):
            try:
                self._write_pending()
            except OSError as exc:  # a full disk: say so, keep serving, try again next round
                log.warning("request_log.write_failed", path=str(self.path), error=str(exc))

    def close(self) -> None:
        """Writes every queued request and closes the file (at shutdown)."""
        self._stop.set()
        self._thread.join()
        try:
            self._write_pending()
        finally:
            self._file.close()
        log.info("request_log.closed", path=str(self.path), requests=self.num_written)
