"""Who may drive the executor: one scheduler's lease at a time, kept live by its steps and heartbeats.

An executor is shared by schedulers that know nothing of each other (replicas behind a Service, a
scheduler restarted elsewhere). The lease decides which of them owns the runner's state:

* `attach` starts a new epoch. While another scheduler's lease is live it is refused, naming the
  holder, so a second scheduler cannot steal an executor in use (it used to: Attach was
  unconditional). The same scheduler id may always attach again (it restarted, or lost its stream):
  that is a new epoch, and every older epoch is fenced.
* A lease is live while it has seen a plan or a heartbeat within `timeout_s` (`touch`/`heartbeat`).
  An open but idle Step stream does not count: a scheduler that died with its TCP connection held
  open (a frozen process, a partitioned host) would otherwise keep the executor forever.
* `expire_if_due` ends a lease past its timeout; `detach` ends one at once (a draining scheduler).

It knows nothing of gRPC or of the runner: the service maps its exceptions onto statuses and frees
the runner's state when a lease ends. The clock is injected so the tests can move time by hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

DEFAULT_LEASE_TIMEOUT_S = 10.0


class LeaseHeld(Exception):
    """Attach refused: another scheduler's lease is live. The message names the holder."""


class StaleLease(Exception):
    """The epoch is not the current live lease (superseded, expired, detached, or never granted)."""


@dataclass(frozen=True, slots=True)
class LeaseHolder:
    """The scheduler holding a lease, as it introduced itself on Attach."""

    scheduler_id: str
    peer: str
    epoch: int

    def __str__(self) -> str:
        return f"scheduler {self.scheduler_id!r} at {self.peer} (lease epoch {self.epoch})"


def _wall_clock_epoch() -> int:
    # Epochs grow across restarts too (wall-clock microseconds), so a stream fenced by an earlier
    # executor process can never match by accident.
    return time.time_ns() // 1000


class Lease:
    """The executor's single lease. Thread-safe (its own lock, held only for bookkeeping)."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        epoch_source: Callable[[], int] = _wall_clock_epoch,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"lease timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._epoch_source = epoch_source
        self._lock = threading.Lock()
        self._last_epoch = 0  # the newest epoch ever granted; never reused
        self._holder: LeaseHolder | None = None  # None = free
        self._last_seen = 0.0  # clock time of the holder's last plan or heartbeat

    @property
    def holder(self) -> LeaseHolder | None:
        """The lease's holder until it is detached or expired by `expire_if_due` (it may be past
        due already); None when the executor is free."""
        return self._holder

    @property
    def epoch(self) -> int:
        """The epoch of `holder`; 0 when the executor is free."""
        holder = self._holder
        return 0 if holder is None else holder.epoch

    def attach(self, scheduler_id: str, peer: str) -> tuple[int, LeaseHolder | None]:
        """Grants a new lease to `scheduler_id`; returns its epoch and the lease it replaced (None
        if there was none, live or past due). Raises LeaseHeld while another scheduler's lease is
        live."""
        with self._lock:
            previous = self._holder
            live = self._live_locked()
            if live is not None and live.scheduler_id != scheduler_id:
                remaining = self.timeout_s - (self._clock() - self._last_seen)
                raise LeaseHeld(
                    f"executor is leased to {live}; that lease expires if it sees no step and no "
                    f"heartbeat for {remaining:.1f} s more (--lease-timeout {self.timeout_s:g} s)"
                )
            self._last_epoch = max(self._last_epoch + 1, self._epoch_source())
            self._holder = LeaseHolder(scheduler_id, peer, self._last_epoch)
            self._last_seen = self._clock()
            return self._last_epoch, previous

    def check(self, epoch: int) -> None:
        """Raises StaleLease unless `epoch` is the live lease."""
        with self._lock:
            self._check_locked(epoch)

    def touch(self, epoch: int) -> bool:
        """Records a plan of lease `epoch` (it keeps the lease live); False if that lease is gone."""
        with self._lock:
            live = self._live_locked()
            if live is None or live.epoch != epoch:
                return False
            self._last_seen = self._clock()
            return True

    def heartbeat(self, epoch: int) -> None:
        """Keeps an idle lease live; raises StaleLease once it is gone (the holder must re-attach)."""
        with self._lock:
            self._check_locked(epoch)
            self._last_seen = self._clock()

    def detach(self, epoch: int) -> LeaseHolder:
        """Ends lease `epoch` at once; returns its holder. Raises StaleLease if it is not live."""
        with self._lock:
            self._check_locked(epoch)
            holder, self._holder = self._holder, None
            assert holder is not None
            return holder

    def expire_if_due(self) -> LeaseHolder | None:
        """Ends the lease if it has seen nothing for `timeout_s`; returns the expired holder."""
        with self._lock:
            holder = self._holder
            if holder is None or self._live_locked() is not None:
                return None
            self._holder = None
        log.warning(
            "executor.lease_expired",
            scheduler_id=holder.scheduler_id,
            peer=holder.peer,
            lease_epoch=holder.epoch,
            timeout_s=self.timeout_s,
        )
        return holder

    def seconds_until_expiry(self) -> float | None:
        """How long the lease has left (negative: past due); None when the executor is free."""
        with self._lock:
            if self._holder is None:
                return None
            return self.timeout_s - (self._clock() - self._last_seen)

    def _live_locked(self) -> LeaseHolder | None:
        """The holder if its lease is live; None if free or past due (until `expire_if_due` ends it,
        a lease past due refuses heartbeats and steps, and yields to any Attach)."""
        holder = self._holder
        if holder is None or self._clock() - self._last_seen > self.timeout_s:
            return None
        return holder

    def _check_locked(self, epoch: int) -> None:
        holder = self._live_locked()
        if holder is None:
            if epoch and self._holder is not None and epoch == self._holder.epoch:
                raise StaleLease(
                    f"lease epoch {epoch} expired (no step or heartbeat for {self.timeout_s:g} s)"
                )
            if epoch and epoch == self._last_epoch:
                raise StaleLease(f"lease epoch {epoch} expired or was detached; Attach again")
            raise StaleLease(f"stale lease: epoch {epoch}, and no lease is live (Attach first)")
        if epoch != holder.epoch:
            raise StaleLease(f"stale lease: epoch {epoch}, current epoch {holder.epoch} held by {holder}")
