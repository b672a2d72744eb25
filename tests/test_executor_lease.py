"""The executor's lease on its own (no gRPC): who may attach, what keeps a lease live, expiry on a
clock the test moves by hand, heartbeats and detach on stale epochs."""

from __future__ import annotations

import pytest

from pagedserve.executor.lease import Lease, LeaseHeld, StaleLease

TIMEOUT = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def lease(clock) -> Lease:
    epochs = iter(range(100, 10_000, 100))
    return Lease(TIMEOUT, clock=clock, epoch_source=lambda: next(epochs))


def test_a_live_lease_refuses_another_scheduler_naming_the_holder(lease, clock):
    epoch, previous = lease.attach("sched-a", "ipv4:10.0.0.1:4242")
    assert previous is None
    assert lease.epoch == epoch
    clock.advance(TIMEOUT - 0.1)
    with pytest.raises(LeaseHeld) as refused:
        lease.attach("sched-b", "ipv4:10.0.0.2:999")
    message = str(refused.value)
    assert "'sched-a'" in message
    assert "ipv4:10.0.0.1:4242" in message
    assert str(epoch) in message
    assert lease.epoch == epoch  # nothing changed
    lease.check(epoch)


def test_an_idle_lease_expires_after_the_timeout_and_frees_the_executor(lease, clock):
    epoch, _ = lease.attach("sched-a", "peer-a")
    clock.advance(TIMEOUT)
    assert lease.expire_if_due() is None  # exactly the timeout: still live
    clock.advance(0.01)
    expired = lease.expire_if_due()
    assert (expired.scheduler_id, expired.peer, expired.epoch) == ("sched-a", "peer-a", epoch)
    assert lease.holder is None
    assert lease.expire_if_due() is None
    with pytest.raises(StaleLease, match="expired"):
        lease.check(epoch)
    new_epoch, previous = lease.attach("sched-b", "peer-b")
    assert previous is None
    assert new_epoch > epoch
    assert not lease.touch(epoch)  # a plan of the old lease keeps nothing alive


def test_a_lease_past_due_yields_to_attach_before_it_is_expired(lease, clock):
    epoch, _ = lease.attach("sched-a", "peer-a")
    clock.advance(TIMEOUT + 1)
    with pytest.raises(StaleLease):
        lease.heartbeat(epoch)  # too late: the holder must attach again
    new_epoch, previous = lease.attach("sched-b", "peer-b")
    assert previous.epoch == epoch
    assert new_epoch > epoch  # the service fences `previous`
    assert lease.expire_if_due() is None  # the new lease is live


@pytest.mark.parametrize("keep_alive", ["heartbeat", "touch"])
def test_heartbeats_and_plans_keep_a_lease_live(lease, clock, keep_alive):
    epoch, _ = lease.attach("sched-a", "peer-a")
    for _ in range(5):
        clock.advance(TIMEOUT * 0.6)
        if keep_alive == "heartbeat":
            lease.heartbeat(epoch)
        else:
            assert lease.touch(epoch)
    assert lease.expire_if_due() is None
    with pytest.raises(LeaseHeld):
        lease.attach("sched-b", "peer-b")
    assert lease.seconds_until_expiry() == pytest.approx(TIMEOUT)


def test_the_same_scheduler_may_attach_again_and_fences_its_older_epoch(lease, clock):
    first, _ = lease.attach("sched-a", "peer-a")
    clock.advance(1)
    second, previous = lease.attach("sched-a", "peer-a2")  # restarted, new connection
    assert second > first
    assert previous.epoch == first
    with pytest.raises(StaleLease, match="stale lease") as stale:
        lease.check(first)
    assert str(second) in str(stale.value)
    with pytest.raises(StaleLease):
        lease.heartbeat(first)
    assert not lease.touch(first)
    lease.heartbeat(second)


def test_detach_ends_the_lease_at_once_and_a_stale_epoch_is_refused(lease, clock):
    epoch, _ = lease.attach("sched-a", "peer-a")
    with pytest.raises(StaleLease):
        lease.detach(epoch + 1)
    assert lease.detach(epoch).scheduler_id == "sched-a"
    assert lease.holder is None
    for call in (lease.detach, lease.heartbeat, lease.check):
        with pytest.raises(StaleLease):
            call(epoch)
    other, _ = lease.attach("sched-b", "peer-b")  # no waiting for the timeout
    assert other > epoch


def test_heartbeat_on_an_epoch_never_granted_is_refused(lease):
    with pytest.raises(StaleLease, match="Attach first"):
        lease.heartbeat(12345)
    epoch, _ = lease.attach("sched-a", "peer-a")
    with pytest.raises(StaleLease, match=f"current epoch {epoch}"):
        lease.heartbeat(12345)


def test_epochs_grow_even_when_the_clock_source_goes_back(clock):
    lease = Lease(TIMEOUT, clock=clock, epoch_source=lambda: 5)
    epochs = [lease.attach("a", "p")[0] for _ in range(3)]
    assert epochs == [5, 6, 7]


@pytest.mark.parametrize("timeout", [0, -1, float("nan")])
def test_a_timeout_must_be_positive(timeout):
    with pytest.raises(ValueError, match="positive"):
        Lease(timeout)
