"""ClientThrottle in one event loop: per-client turns, backlog limit, deadline, forgetting idle
clients; the client key of a gRPC request. (tests/test_throttle_e2e.py drives it through a server.)"""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.scheduler.throttle import MAX_CLIENT_ID_CHARS, BacklogFull, ClientThrottle, client_key

PERIOD = 0.2  # a fast "second", so the tests take a fraction of one


def test_client_key():
    assert client_key([("x-client-id", "tenant-7")], "ipv4:10.0.0.7:5311") == "id:tenant-7"
    assert client_key([("other", "v")], "ipv4:10.0.0.7:5311") == "peer:ipv4:10.0.0.7"
    assert client_key([], "ipv6:[::1]:5311") == "peer:ipv6:[::1]"
    assert client_key(None, "unix:/tmp/s.sock") == "peer:unix:/tmp/s.sock"
    assert client_key([("x-client-id", "")], "ipv4:1.2.3.4:1") == "peer:ipv4:1.2.3.4"
    assert len(client_key([("x-client-id", "x" * 10_000)], "")) == len("id:") + MAX_CLIENT_ID_CHARS


def test_a_burst_waits_its_turn_without_holding_up_another_client():
    async def run() -> list[str]:
        throttle = ClientThrottle(rate_limit=2, max_waiting=100, period=PERIOD)
        order: list[str] = []

        async def request(client: str, i: int) -> None:
            await throttle.admit(client)
            order.append(f"{client}{i}")

        burst = [asyncio.create_task(request("A", i)) for i in range(8)]
        await asyncio.sleep(0.01)  # A's burst is queued first
        await request("B", 0)
        assert throttle.waiting("A") == 6  # two started, the rest wait in line
        await asyncio.gather(*burst)
        return order

    order = asyncio.run(run())
    # B started right after A's first two (its own window was free), before any A that waited;
    # A's requests started in the order they came.
    assert order[:3] == ["A0", "A1", "B0"]
    assert order[3:] == [f"A{i}" for i in range(2, 8)]


def test_a_backlog_beyond_max_waiting_is_refused():
    async def run() -> None:
        throttle = ClientThrottle(rate_limit=1, max_waiting=2, period=PERIOD)
        await throttle.admit("A")
        waiting = [asyncio.create_task(throttle.admit("A")) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(BacklogFull, match="2 requests waiting"):
            await throttle.admit("A")
        await throttle.admit("B")  # another client is not affected
        await asyncio.gather(*waiting)
        assert throttle.waiting("A") == 0

    asyncio.run(run())


def test_the_deadline_ends_the_wait_and_counts_nothing():
    async def run() -> None:
        throttle = ClientThrottle(rate_limit=1, max_waiting=10, period=PERIOD)
        await throttle.admit("A")
        with pytest.raises(TimeoutError):
            await throttle.admit("A", timeout=PERIOD / 4)
        assert throttle.waiting("A") == 0
        await asyncio.wait_for(throttle.admit("A"), timeout=2 * PERIOD)  # the next slot is still free

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_line():
    async def run() -> None:
        throttle = ClientThrottle(rate_limit=1, max_waiting=10, period=PERIOD)
        await throttle.admit("A")
        waiter = asyncio.create_task(throttle.admit("A"))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert throttle.waiting("A") == 0

    asyncio.run(run())


def test_idle_clients_are_forgotten():
    async def run() -> None:
        throttle = ClientThrottle(rate_limit=5, max_waiting=10, period=0.05)
        for i in range(200):
            await throttle.admit(f"client-{i}")
        assert throttle.num_clients == 200
        await asyncio.sleep(0.12)
        await throttle.admit("late")
        assert throttle.num_clients == 1

    asyncio.run(run())
