"""One engine over several executors, in one process: fake executors (benchmarks.hotpath's,
which sample a token determined by the request's prompt and position, as the real sampler keys by
seed and position) that can die, refuse or disagree. The same paths run against real executor
processes in tests/test_scale_out_e2e.py; here they are fast and exhaustive."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from benchmarks.hotpath import FakeExecutor
from pagedserve.protos import executor_pb2
from pagedserve.scheduler.completion import StopConditions
from pagedserve.scheduler.engine import Engine
from pagedserve.scheduler.request import SamplingOptions
from pagedserve.scheduler.service import load_tokenizer
from pagedserve.scheduler.service_config import ServiceConfig
from pagedserve.tiny_model import CORPUS

MAX_TOKENS = 24


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FlakyExecutor(FakeExecutor):
    """A fake executor that can be down, held by another scheduler, or serve another vocabulary."""

    def __init__(self, text_ids, vocab_size, step_seconds=0.002, lease_timeout_ms=0):
        super().__init__(text_ids, vocab_size, [], step_seconds)
        self.up = True
        self.holder: str | None = None
        self.epoch = 0
        self.lease_timeout_ms = lease_timeout_ms
        self.heartbeat_error: grpc.aio.AioRpcError | None = None
        self.heartbeats = 0
        self.detached: list[int] = []
        self.steps = 0

    async def attach(self, scheduler_id, timeout):
        if not self.up:
            raise RuntimeError("connection refused")
        if self.holder is not None:
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, f"leased by {self.holder}")
        self.epoch += 1
        reply = await super().attach(scheduler_id, timeout)
        reply.lease_epoch = self.epoch
        reply.num_gpu_blocks = 1024  # a fast core to build
        reply.lease_timeout_ms = self.lease_timeout_ms
        return reply

    def open_steps(self, lease_epoch):
        steps = super().open_steps(lease_epoch)
        executor = self

        class Steps:
            async def write(self, plan):
                if not executor.up or executor.epoch != lease_epoch:
                    raise RuntimeError("the executor died")
                executor.steps += 1
                await steps.write(plan)

            async def read(self):
                if not executor.up:
                    raise RuntimeError("the executor died")
                return await steps.read()

            def cancel(self):
                steps.cancel()

            def ended(self):
                return not executor.up

        return Steps()

    async def heartbeat(self, lease_epoch, timeout):
        self.heartbeats += 1
        if self.heartbeat_error is not None:
            raise self.heartbeat_error

    async def detach(self, lease_epoch, timeout):
        self.detached.append(lease_epoch)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    return tokenizer.encode(CORPUS, add_special_tokens=False)


def expected_tokens(text_ids, prompt, n=MAX_TOKENS):
    """What the fake executor samples for `prompt`, undisturbed."""
    offset = prompt[0] * 997 + len(prompt) * 31
    return [text_ids[(offset + k) % len(text_ids)] for k in range(n)]


async def collect(active) -> list[int]:
    tokens = []
    while True:
        item = await active.deltas.get()
        if isinstance(item, Exception):
            raise item
        tokens += item.token_ids
        if item.finish_reason is not None:
            return tokens


class Harness:
    def __init__(self, tokenizer, fakes: dict[str, FlakyExecutor], **config):
        config.setdefault("executors", tuple(fakes))
        config.setdefault("executor_refresh_interval", 0.1)
        self.fakes = fakes
        self.engine = Engine(ServiceConfig(model="m", **config), tokenizer, lambda a: self.fakes[a])

    async def __aenter__(self):
        self.task = asyncio.create_task(self.engine.run())
        await asyncio.wait_for(self.engine.wait_until_attached(), 10)
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task

    def submit(self, prompt, max_tokens=MAX_TOKENS):
        return self.engine.submit(
            f"r{prompt[0]}", prompt, SamplingOptions(temperature=0), StopConditions(max_tokens=max_tokens)
        )

    def status(self, address):
        return next(s for s in self.engine.executor_statuses() if s.address == address)

    async def until(self, condition, timeout=10.0):
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.01)


def prompts(n):
    return [[10 + i, 20 + i, 30 + i, 40 + i] * (1 + i % 3) for i in range(n)]


def test_requests_spread_and_survive_the_loss_of_an_executor(tokenizer, text_ids):
    fakes = {f"e{i}:1": FlakyExecutor(text_ids, len(tokenizer)) for i in range(3)}

    async def scenario():
        async with Harness(tokenizer, fakes) as h:
            await h.until(lambda: all(s.attached for s in h.engine.executor_statuses()))
            actives = [h.submit(p) for p in prompts(12)]
            routed = [h.status(a).requests_routed for a in fakes]
            assert min(routed) >= 3, routed
            assert sum(routed) == 12, routed  # balanced by queued tokens
            moved = len(h.engine._replicas["e1:1"].seq_ids)
            await h.until(lambda: fakes["e1:1"].steps >= 5)
            counters_before = h.engine.core_stats()
            fakes["e1:1"].up = False
            results = await asyncio.wait_for(asyncio.gather(*(collect(a) for a in actives)), 20)
            for prompt, tokens in zip(prompts(12), results, strict=True):
                assert tokens == expected_tokens(text_ids, prompt)  # no duplicate, no gap
            lost = h.status("e1:1")
            assert not lost.attached
            assert lost.state.startswith("lost: ")
            assert sum(s.requests_routed for s in h.engine.executor_statuses()) == 12 + moved
            after = h.engine.core_stats()
            for name in ("prompt_tokens_computed", "prefix_cache_query_tokens", "num_preemptions"):
                assert getattr(after, name) >= getattr(counters_before, name)
            assert h.engine.tokens_generated == 12 * MAX_TOKENS
            fakes["e1:1"].up = True  # it comes back: re-attached under a new lease
            await h.until(lambda: h.status("e1:1").attached)
            assert h.status("e1:1").lease_epoch == 2
            assert h.status("e1:1").state == "attached"
            assert h.status("e0:1").steps > 0
            assert h.status("e0:1").busy_seconds >= 0

    asyncio.run(scenario())


def test_a_step_planned_ahead_is_counted_once_it_returns(tokenizer, text_ids):
    """A stop token ends a request while the step planned one ahead still runs (and the plan that
    tells the executor to drop the request follows it): the request is done and its blocks free,
    but `steps` settles only when `num_steps_in_flight` is back to 0."""
    fakes = {"only:1": FlakyExecutor(text_ids, len(tokenizer), step_seconds=0.2)}
    prompt = prompts(1)[0]
    stop_id = expected_tokens(text_ids, prompt)[2]

    async def scenario():
        async with Harness(tokenizer, fakes) as h:
            active = h.engine.submit(
                "r",
                prompt,
                SamplingOptions(temperature=0),
                StopConditions(MAX_TOKENS, stop_token_ids=frozenset({stop_id})),
            )
            assert (await collect(active))[-1] == stop_id
            stats = h.engine.core_stats()
            assert (h.engine.num_active_requests, stats.gpu_blocks_in_use) == (0, 0)
            assert h.engine.num_steps_in_flight >= 1
            assert h.engine.steps < fakes["only:1"].steps  # sent, not yet counted
            await h.until(lambda: h.engine.num_steps_in_flight == 0)
            assert h.engine.steps == fakes["only:1"].steps

    asyncio.run(scenario())


def test_requests_wait_while_no_executor_is_attached(tokenizer, text_ids):
    fakes = {"only:1": FlakyExecutor(text_ids, len(tokenizer))}

    async def scenario():
        async with Harness(tokenizer, fakes) as h:
            first = h.submit(prompts(1)[0], max_tokens=200)
            await h.until(lambda: fakes["only:1"].steps >= 3)
            fakes["only:1"].up = False
            await h.until(lambda: not h.engine.is_serving)
            second = h.submit(prompts(2)[1])  # queued in the engine, not refused
            await asyncio.sleep(0.3)
            assert h.engine.core_stats().num_waiting == 2
            assert h.engine.model_info() is not None
            fakes["only:1"].up = True
            tokens = await asyncio.wait_for(asyncio.gather(collect(first), collect(second)), 20)
            assert tokens[0] == expected_tokens(text_ids, prompts(1)[0], 200)
            assert tokens[1] == expected_tokens(text_ids, prompts(2)[1])

    asyncio.run(scenario())


def test_a_lease_held_elsewhere_is_retried_until_free(tokenizer, text_ids):
    fakes = {
        "a:1": FlakyExecutor(text_ids, len(tokenizer)),
        "held:1": FlakyExecutor(text_ids, len(tokenizer)),
    }
    fakes["held:1"].holder = "scheduler@elsewhere:50051"

    async def scenario():
        async with Harness(tokenizer, fakes) as h:
            await h.until(lambda: h.status("held:1").state.startswith("refused"))
            assert h.status("held:1").state == "refused: leased by scheduler@elsewhere:50051"
            fakes["held:1"].holder = None  # the other scheduler's lease expired
            await h.until(lambda: h.status("held:1").attached)

    asyncio.run(scenario())


def test_spares_beyond_max_executors_replace_a_lost_one(tokenizer, text_ids):
    fakes = {"a:1": FlakyExecutor(text_ids, len(tokenizer)), "b:1": FlakyExecutor(text_ids, len(tokenizer))}

    async def scenario():
        async with Harness(tokenizer, fakes, max_executors=1) as h:
            await h.until(lambda: {s.state for s in h.engine.executor_statuses()} == {"attached", "spare"})
            (attached,) = [s.address for s in h.engine.executor_statuses() if s.attached]
            (spare,) = [a for a in fakes if a != attached]
            fakes[attached].up = False
            await h.until(lambda: h.status(spare).attached)
            fakes[attached].up = True
            await h.until(lambda: h.status(attached).state == "spare")
            assert sum(s.attached for s in h.engine.executor_statuses()) == 1

    asyncio.run(scenario())


def test_an_executor_of_another_model_is_refused(tokenizer, text_ids):
    vocab = len(tokenizer)
    fakes = {"a:1": FlakyExecutor(text_ids, vocab), "b:1": FlakyExecutor(text_ids, vocab + 1)}
    fakes["b:1"].up = False  # comes up once "a" set the model

    async def scenario():
        async with Harness(tokenizer, fakes) as h:
            fakes["b:1"].up = True
            await h.until(lambda: h.status("b:1").state.startswith("refused"))
            assert "vocab_size" in h.status("b:1").state
            assert not h.status("b:1").attached
            assert fakes["b:1"].detached == [1]  # its lease given back at once

    asyncio.run(scenario())


def test_heartbeats_while_idle_and_a_fenced_lease(tokenizer, text_ids):
    fakes = {"a:1": FlakyExecutor(text_ids, len(tokenizer), lease_timeout_ms=150)}
    fake = fakes["a:1"]

    async def scenario():
        async with Harness(tokenizer, fakes) as h:
            await h.until(lambda: fake.heartbeats >= 3, timeout=5)  # every 50 ms while idle
            # Another scheduler took the lease: the next heartbeat is refused, and so is Attach.
            fake.holder = "scheduler@b:1"
            fake.heartbeat_error = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "stale lease")
            await h.until(lambda: h.status("a:1").state.startswith("refused"))
            assert not h.engine.is_serving
            waiting = h.submit(prompts(1)[0])  # waits for an executor
            # The lease is free again, on an executor that does not implement Heartbeat.
            fake.heartbeat_error = rpc_error(grpc.StatusCode.UNIMPLEMENTED, "no leases here")
            fake.holder = None
            assert await asyncio.wait_for(collect(waiting), 10) == expected_tokens(text_ids, prompts(1)[0])
            count = fake.heartbeats
            await asyncio.sleep(0.3)
            assert h.status("a:1").attached
            assert fake.heartbeats <= count + 1  # tolerated, not asked again
            await h.engine.release_executors()
            assert fake.detached == [fake.epoch]
            assert h.status("a:1").state == "released"
            assert not h.engine.is_serving

    asyncio.run(scenario())


def test_dns_names_are_re_resolved(tokenizer, text_ids, monkeypatch):
    """Addresses that appear are attached; one that vanishes is dropped and its requests move."""
    records = {"pool": ["10.0.0.1", "10.0.0.2"]}

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in records[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    fakes = {f"10.0.0.{i}:7": FlakyExecutor(text_ids, len(tokenizer)) for i in (1, 2, 3)}

    async def scenario():
        async with Harness(tokenizer, fakes, executors=("dns:///pool:7",)) as h:
            await h.until(lambda: len([s for s in h.engine.executor_statuses() if s.attached]) == 2)
            actives = [h.submit(p, max_tokens=60) for p in prompts(6)]
            records["pool"] = ["10.0.0.2", "10.0.0.3"]
            await h.until(
                lambda: [s.address for s in h.engine.executor_statuses()] == ["10.0.0.2:7", "10.0.0.3:7"]
            )
            results = await asyncio.wait_for(asyncio.gather(*(collect(a) for a in actives)), 20)
            for prompt, tokens in zip(prompts(6), results, strict=True):
                assert tokens == expected_tokens(text_ids, prompt, 60)
            assert fakes["10.0.0.1:7"].detached == [1]
            assert h.engine.core_stats().prompt_tokens_computed >= sum(map(len, prompts(6)))

    asyncio.run(scenario())


def test_submit_before_any_executor_attached_is_unavailable(tokenizer):
    from pagedserve.scheduler.engine import EngineUnavailable

    engine = Engine(ServiceConfig(model="m"), tokenizer)
    with pytest.raises(EngineUnavailable, match="no executor has attached yet"):
        engine.submit("x", [1, 2], SamplingOptions(), StopConditions(max_tokens=2))
    assert engine.model_info() is None
    assert not engine.is_serving
    assert engine.core_stats().num_gpu_blocks == 0
    assert engine.executor_statuses() == []


@pytest.mark.parametrize("override", [None, 0])
def test_the_tiers_loads_per_plan_come_from_the_bandwidths_the_executor_reports(
    tokenizer, text_ids, monkeypatch, override
):
    """An executor with a CPU tier reports its host link; the replica's core loads no more blocks a
    plan than that link moves while the device reads the weights once (kv_tier.load_budget), unless
    PAGEDSERVE_MAX_NUM_LOADED_BLOCKS says otherwise (0: no limit)."""
    from pagedserve.scheduler import replica

    monkeypatch.setattr(replica, "LOAD_BUDGET_OVERRIDE", override)

    class TierExecutor(FlakyExecutor):
        async def attach(self, scheduler_id, timeout):
            reply = await super().attach(scheduler_id, timeout)
            reply.num_cpu_blocks = reply.num_cpu_offload_blocks = 64
            reply.bytes_per_block, reply.weight_read_bytes = 2 << 20, 15_009_849_344
            reply.copy_bytes_per_s, reply.host_copy_bytes_per_s = 3.87e12, 55.3e9
            return reply

    fakes = {
        "tier:1": TierExecutor(text_ids, len(tokenizer)),
        "plain:1": FlakyExecutor(text_ids, len(tokenizer)),
    }

    async def scenario():
        async with Harness(tokenizer, fakes) as h:
            await h.until(lambda: all(s.attached for s in h.engine.executor_statuses()))
            budgets = {a: r.scheduler.config.max_num_loaded_blocks for a, r in h.engine._replicas.items()}
            assert budgets == (
                {"tier:1": 102, "plain:1": 0} if override is None else {"tier:1": 0, "plain:1": 0}
            )

    asyncio.run(scenario())


def test_attach_response_has_the_lease_timeout():
    assert "lease_timeout_ms" in executor_pb2.AttachResponse.DESCRIPTOR.fields_by_name


@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
def test_requests_placed_together_follow_their_prefix(tokenizer, text_ids, policy):
    """W4 in miniature: 8 prefixes of 4 blocks, 4 requests each with their own suffix, arriving
    interleaved and all placed before any step runs (nothing is cached yet), over 3 executors. Prefix
    routing keeps each prefix on one executor (but at most one) and computes it once there: the requests that
    follow the first see its queued prefix, and those admitted in its step share its blocks. Round
    robin places by arrival alone: each prefix is computed on all three."""
    fakes = {f"e{i}:1": FlakyExecutor(text_ids, len(tokenizer)) for i in range(3)}
    prefix_len, suffix_len, num_prefixes, per_prefix = 64, 8, 8, 4

    def prompt(p, r):
        prefix = [text_ids[(p * 131 + k) % len(text_ids)] for k in range(prefix_len)]
        return [100 + p] + prefix[1:] + [text_ids[(r * 17 + k) % len(text_ids)] for k in range(suffix_len)]

    async def scenario():
        async with Harness(tokenizer, fakes, routing_policy=policy) as h:
            await h.until(lambda: all(s.attached for s in h.engine.executor_statuses()))
            placed = []
            for r in range(per_prefix):
                for p in range(num_prefixes):
                    greedy, stop = SamplingOptions(temperature=0), StopConditions(max_tokens=4)
                    active = h.engine.submit(f"r{p}-{r}", prompt(p, r), greedy, stop)
                    placed.append((p, active, active.replica.address))
            await asyncio.wait_for(asyncio.gather(*(collect(a) for _, a, _ in placed)), 30)
            homes = {p: {address for q, _, address in placed if q == p} for p in range(num_prefixes)}
            computed = h.engine.core_stats().prompt_tokens_computed
            suffixes = num_prefixes * per_prefix * suffix_len
            if policy == "prefix":
                # At most one prefix gets a second home: 8 prefixes do not split evenly over 3
                # executors, and load may outweigh a hit (see scheduler/router.py).
                assert sum(len(h) for h in homes.values()) <= num_prefixes + 1, homes
                assert computed <= (num_prefixes + 1) * prefix_len + suffixes
            else:
                assert all(len(h) == 3 for h in homes.values()), homes
                assert computed == 3 * num_prefixes * prefix_len + suffixes

    asyncio.run(scenario())
