"""The internal token between the tiers, on real processes: the scheduler sends it on every executor
call, the executor refuses every RPC without it (UNAUTHENTICATED, the handler never runs) but the
standard health service, and the token comes from PAGEDSERVE_INTERNAL_TOKEN or a file (which wins).
"""

from __future__ import annotations

import os
import secrets

import grpc
import pytest

from pagedserve.client import generate, make_request
from pagedserve.common.auth import BearerTokenInterceptor, TokenError, bearer_metadata, read_internal_token
from pagedserve.protos import executor_pb2, executor_pb2_grpc, wire
from tests.services import free_port, running_services, wait_for_idle

TOKEN = secrets.token_hex(16)


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    token_file = logs / "internal-token"
    token_file.write_text(TOKEN + "\n")  # as a secret file usually ends: stripped
    # The scheduler reads the variable; the executor its file, which wins over a wrong variable.
    with running_services(
        tiny_model_dir,
        logs,
        executor_args=(f"--internal-token-file={token_file}",),
        env={wire.INTERNAL_TOKEN_ENV: TOKEN},
    ) as s:
        yield s


@pytest.mark.slow
def test_scheduler_with_the_token_serves_end_to_end(services):
    with services.channel() as channel:
        result = generate(channel, make_request([5, 6, 7], max_tokens=6, ignore_eos=True), timeout=60)
    assert len(result.token_ids) == 6
    assert result.usage.completion_tokens == 6
    assert wait_for_idle(services).gpu_blocks_in_use == 0
    assert "internal link unauthenticated" not in services.scheduler_log() + services.executor_log()


def _executor_calls(channel: grpc.Channel, metadata) -> dict[str, object]:
    """Every Executor RPC once, with `metadata`; each returns its RpcError (or its reply)."""
    stub = executor_pb2_grpc.ExecutorStub(channel)
    step_metadata = (*metadata, *wire.lease_metadata(1))
    calls = {
        "Attach": lambda: stub.Attach(executor_pb2.AttachRequest(scheduler_id="intruder"), metadata=metadata),
        "Step": lambda: list(stub.Step(iter([executor_pb2.StepPlan(step_id=1)]), metadata=step_metadata)),
        "GetStats": lambda: stub.GetStats(executor_pb2.GetStatsRequest(), metadata=metadata),
        "Heartbeat": lambda: stub.Heartbeat(executor_pb2.HeartbeatRequest(), metadata=metadata),
        "Detach": lambda: stub.Detach(executor_pb2.DetachRequest(), metadata=metadata),
    }
    results = {}
    for name, call in calls.items():
        try:
            results[name] = call()
        except grpc.RpcError as exc:
            results[name] = exc
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ((), "missing"),
        (((wire.AUTHORIZATION_KEY, "Bearer not-the-token"),), "wrong internal token"),
        (((wire.AUTHORIZATION_KEY, TOKEN),), "wrong internal token"),  # no "Bearer "
        (((wire.AUTHORIZATION_KEY, f"Bearer {TOKEN}x"),), "wrong internal token"),
    ],
    ids=["missing", "wrong", "not-bearer", "longer"],
)
def test_executor_refuses_every_call_without_the_right_token(services, metadata, reason):
    with grpc.insecure_channel(f"127.0.0.1:{services.executor_port}") as channel:
        results = _executor_calls(channel, metadata)
    for name, result in results.items():
        assert isinstance(result, grpc.RpcError), name
        assert result.code() == grpc.StatusCode.UNAUTHENTICATED, (name, result.details())
        assert reason in result.details(), result.details()
    # Nothing else happened: the refused Attach took no lease (the scheduler's attach is the only
    # one), and the scheduler keeps serving on its stream without losing the executor.
    with services.channel() as channel:
        result = generate(channel, make_request([9, 10], max_tokens=4, ignore_eos=True), timeout=60)
    assert len(result.token_ids) == 4
    assert services.executor_log().count("executor.attach") == 1
    assert "executor lost" not in services.scheduler_log()


@pytest.mark.slow
def test_executor_accepts_the_right_token_and_leaves_health_open(services):
    with grpc.insecure_channel(f"127.0.0.1:{services.executor_port}") as channel:
        stats = executor_pb2_grpc.ExecutorStub(channel).GetStats(
            executor_pb2.GetStatsRequest(), metadata=bearer_metadata(TOKEN), timeout=10
        )
        assert stats.steps > 0  # the scheduler's steps went through with its token
        # Probes carry no token: grpc.health.v1 is never refused for it (UNIMPLEMENTED until the
        # executor registers the health service, SERVING after).
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=bytes)
        try:
            check(b"", timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() != grpc.StatusCode.UNAUTHENTICATED, exc.details()


def test_token_sources(tmp_path):
    env = {wire.INTERNAL_TOKEN_ENV: "  from-env\n"}
    assert read_internal_token(None, env) == "from-env"
    assert read_internal_token(None, {}) is None
    assert read_internal_token(None, {wire.INTERNAL_TOKEN_ENV: "  "}) is None
    (tmp_path / "t").write_text("from-file\n")
    assert read_internal_token(str(tmp_path / "t"), env) == "from-file"  # the file wins
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenError, match="empty"):
        read_internal_token(str(tmp_path / "empty"), env)
    with pytest.raises(TokenError, match="cannot read"):
        read_internal_token(str(tmp_path / "absent"), env)


def test_interceptor_check():
    interceptor = BearerTokenInterceptor("s3cret")
    assert interceptor.check(bearer_metadata("s3cret")) is None
    assert "missing" in interceptor.check([("other", "x")])
    assert "wrong" in interceptor.check(bearer_metadata("s3cre"))
    assert "wrong" in interceptor.check([(wire.AUTHORIZATION_KEY, "Basic s3cret")])


@pytest.mark.slow
@pytest.mark.parametrize("service", ["executor", "scheduler"])
def test_an_unreadable_token_file_stops_the_service_in_one_line(service, tiny_model_dir, tmp_path):
    import subprocess
    import sys

    own = {"executor": ["--device=cpu", "--port=0"], "scheduler": [f"--port={free_port()}"]}[service]
    result = subprocess.run(
        [sys.executable, "-m", f"pagedserve.{service}", f"--model={tiny_model_dir}", *own,
         f"--internal-token-file={tmp_path / 'absent'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # The executor's configuration errors exit with os.EX_CONFIG, so that serve does not restart it.
    assert result.returncode == (os.EX_CONFIG if service == "executor" else 1), result.stderr
    assert "cannot read --internal-token-file" in result.stderr
    assert "Traceback" not in result.stderr
