"""Every public request, however malformed or extreme, gets OK or INVALID_ARGUMENT with a message,
never UNKNOWN/INTERNAL (or UNAVAILABLE: a crashed executor), and the service keeps serving with
nothing left behind. Property-based (hypothesis, 1,000 examples) through a real scheduler and
executor sharing one channel.

Where a request is valid, the strategies keep max_tokens at a few tokens (unset only with a prompt
that leaves a few tokens of room), so the 1,000 examples run in about a minute on a CPU.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.protos import generation_pb2, generation_pb2_grpc
from pagedserve.scheduler.service import MAX_REQUEST_ID_CHARS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.services import running_services, scheduler_stats, wait_for_idle

pytestmark = pytest.mark.slow

VOCAB = 512
MAX_MODEL_LEN = 1024
U32 = 2**32 - 1
I32 = 2**31 - 1
U64 = 2**64 - 1


def repeated(element: st.SearchStrategy, low: int, high: int) -> st.SearchStrategy[list]:
    """A long list of one drawn element (cheap for hypothesis, where thousands of drawn elements are not)."""
    return st.builds(lambda n, x: [x] * n, st.integers(low, high), element)


def long_text(low: int, high: int) -> st.SearchStrategy[str]:
    """A long string made of a short drawn one repeated (drawing thousands of characters is slow)."""
    return st.builds(lambda n, c: (c * n)[:high], st.integers(low, high), st.text(min_size=1, max_size=5))


def mostly(valid: st.SearchStrategy, extreme: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` 9 times in 10, else `extreme`: every field bad alone would leave almost no valid
    request (and so no extreme-but-valid one) among the examples."""
    return st.integers(0, 9).flatmap(lambda i: extreme if i == 0 else valid)


float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
# Values valid but extreme come with the valid ones (huge top_k, any seed or priority, near-limit
# lengths); the invalid ones with the extremes.
temperature = mostly(
    st.one_of(
        st.none(),
        st.floats(min_value=0, width=32, allow_infinity=False),
        st.sampled_from([0.0, 1e-30, 1e-6, 3e38]),
    ),
    st.one_of(float32, st.sampled_from([-1.0, -0.5, math.inf, math.nan])),
)
top_p = mostly(
    st.one_of(st.none(), st.floats(0, 1.0, width=32, exclude_min=True), st.just(1.0)),
    st.one_of(float32, st.sampled_from([0.0, -0.1, 1.0000001, math.nan])),
)
top_k = mostly(
    st.one_of(st.none(), st.integers(0, I32), st.integers(0, VOCAB + 2)), st.integers(-I32 - 1, -1)
)
seed = st.one_of(st.none(), st.integers(0, U64), st.just(U64))
priority = st.one_of(st.integers(-I32 - 1, I32), st.sampled_from([-I32 - 1, I32, 0]))
request_id = mostly(
    st.one_of(st.just(""), st.text(max_size=24), long_text(400, MAX_REQUEST_ID_CHARS)),
    long_text(MAX_REQUEST_ID_CHARS + 1, 4000),
)
stop_strings = mostly(
    st.one_of(
        st.lists(st.text(min_size=1, max_size=6), max_size=4),
        repeated(st.text(min_size=1, max_size=3), 1, MAX_STOP_STRINGS),
        st.lists(long_text(100, MAX_STOP_STRING_CHARS), min_size=1, max_size=2),
    ),
    st.one_of(
        st.lists(st.text(max_size=6), min_size=1, max_size=4),  # maybe with an empty one
        repeated(st.text(min_size=1, max_size=3), MAX_STOP_STRINGS + 1, 5000),  # up to thousands
        st.lists(long_text(MAX_STOP_STRING_CHARS + 1, 2000), min_size=1, max_size=2),
    ),
)
stop_token_ids = mostly(
    st.one_of(
        st.lists(st.integers(0, VOCAB - 1), max_size=4),
        repeated(st.integers(0, VOCAB - 1), 1, 5000),  # thousands, one distinct
        st.builds(lambda n: list(range(n)), st.integers(300, VOCAB)),  # many distinct ids
    ),
    st.one_of(
        st.lists(st.integers(VOCAB, U32), min_size=1, max_size=4),
        repeated(st.integers(VOCAB, U32), 1000, 50_000),  # the message lists a few, not all
    ),
)
min_tokens = mostly(st.integers(0, 4), st.one_of(st.integers(5, U32), st.just(U32)))
# Valid max_tokens stay small; the extremes are 0, beyond max_model_len and 2^32-1.
max_tokens = mostly(
    st.integers(1, 4),
    st.one_of(st.sampled_from([0, U32, MAX_MODEL_LEN + 1]), st.integers(MAX_MODEL_LEN + 1, U32)),
)
prompt = mostly(
    st.one_of(
        st.tuples(st.just("ids"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)),
        st.tuples(st.just("text"), st.text(min_size=1, max_size=40)),
    ),
    st.one_of(
        st.tuples(st.just("none"), st.none()),
        st.tuples(st.just("ids"), st.just([])),
        st.tuples(st.just("text"), st.just("")),
        st.tuples(st.just("ids"), st.lists(st.integers(VOCAB, U32), min_size=1, max_size=6)),
        st.tuples(st.just("ids"), repeated(st.integers(0, VOCAB - 1), MAX_MODEL_LEN - 2, MAX_MODEL_LEN + 80)),
        st.tuples(st.just("text"), long_text(3000, 6000)),
    ),
)
near_full_prompt = repeated(st.integers(0, VOCAB - 1), MAX_MODEL_LEN - 8, MAX_MODEL_LEN + 6)


@st.composite
def requests(draw) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        request_id=draw(request_id), priority=draw(priority), return_logprobs=draw(st.booleans())
    )
    s = request.sampling
    for name, strategy in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if (value := draw(strategy)) is not None:
            setattr(s, name, value)
    stopping = request.stopping
    stopping.stop.extend(draw(stop_strings))
    stopping.stop_token_ids.extend(draw(stop_token_ids))
    stopping.ignore_eos = draw(st.booleans())
    stopping.min_tokens = draw(min_tokens)
    if draw(st.integers(0, 19)) == 0:  # max_tokens unset: up to max_model_len, so a prompt near it
        request.token_ids.ids.extend(draw(near_full_prompt))
        return request
    stopping.max_tokens = draw(max_tokens)
    kind, value = draw(prompt)
    if kind == "ids":
        request.token_ids.ids.extend(value)
    elif kind == "text":
        request.text = value
    return request


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    with running_services(tiny_model_dir, tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def stub(services):
    with services.channel() as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def _check(stub, request: generation_pb2.GenerateRequest) -> None:
    tokens, last = 0, None
    try:
        for response in stub.Generate(request, timeout=60):
            tokens += len(response.token_ids)
            last = response
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        assert exc.details(), "INVALID_ARGUMENT without a message"
        event("INVALID_ARGUMENT")
        return
    event("OK")
    assert last is not None
    assert last.finish_reason != 0
    assert last.usage.completion_tokens == tokens
    assert 1 <= tokens <= (request.stopping.max_tokens or MAX_MODEL_LEN)
    s = request.sampling
    # What was accepted was valid: the checks the service must have made.
    assert not s.HasField("temperature") or (math.isfinite(s.temperature) and s.temperature >= 0)
    assert not s.HasField("top_p") or 0 < s.top_p <= 1
    assert len(request.stopping.stop) <= MAX_STOP_STRINGS
    assert len(request.request_id) <= MAX_REQUEST_ID_CHARS


@settings(
    max_examples=1000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(request=requests())
def test_any_request_gets_ok_or_invalid_argument(stub, request):
    _check(stub, request)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS}"),
        (dict(stop=["y" * (MAX_STOP_STRING_CHARS + 1)]), f"at most {MAX_STOP_STRING_CHARS}"),
        (dict(request_id="r" * (MAX_REQUEST_ID_CHARS + 1)), "request_id"),
        # Found by the fuzz: the message once listed every id, and 50,000 of them made a status
        # too large for grpc's metadata (the client saw RESOURCE_EXHAUSTED "Stream removed").
        (dict(stop_token_ids=[VOCAB + i for i in range(50_000)]), "outside the vocabulary"),
    ],
    ids=["many-stop-strings", "long-stop-string", "long-request-id", "50k-bad-stop-ids"],
)
def test_limits_have_clear_messages(stub, kwargs, message):
    from pagedserve.client import make_request

    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(make_request([5, 6], max_tokens=2, **kwargs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert len(err.value.details()) < 300


def test_the_service_still_serves_after_the_fuzz(services, stub):
    # Runs after the fuzz (file order): a normal request, then nothing held.
    request = generation_pb2.GenerateRequest(text="still serving")
    request.stopping.max_tokens = 4
    request.stopping.ignore_eos = True
    assert sum(len(r.token_ids) for r in stub.Generate(request, timeout=60)) == 4
    stats = wait_for_idle(services)
    assert stats.gpu_blocks_in_use == 0
    assert stats.num_active_requests == 0
    assert scheduler_stats(services).tokens_generated > 0
    assert services.scheduler.poll() is None
    assert services.executor.poll() is None
