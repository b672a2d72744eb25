"""The one validation (pagedserve.common.validation) without services: its rules, its order, the
wire it fills, the doors' forms of a refusal, and the guards that make a new field reach every door
and the docs. The four doors with services running: tests/test_bad_input_fuzz.py."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import SamplingParams, cli
from pagedserve.client import make_request
from pagedserve.common.validation import (
    FIELDS,
    InvalidRequest,
    check_fields,
    field_named,
    field_of_wire_path,
    reference_table,
    to_proto,
    validate_request,
    values_from_proto,
)
from pagedserve.protos import generation_pb2, wire
from pagedserve.protos.wire import FLOAT32_MAX, INT32_MAX, UINT32_MAX, UINT64_MAX

REPO = Path(__file__).resolve().parent.parent


def refused(values: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        validate_request({"prompt": "hi", **values})
    return info.value


@pytest.mark.parametrize(
    ("values", "field", "words"),
    [
        ({"max_tokens": 2**32}, "max_tokens", "[1, 2^32-1], got 4294967296"),  # issue 35: once HTTP 500
        ({"top_k": 2**32}, "top_k", "[-1, 2^31-1]"),
        ({"min_tokens": 2**32}, "min_tokens", "[0, 2^32-1]"),
        ({"max_tokens": -1}, "max_tokens", "got -1"),  # issue 35: once a traceback in generate
        ({"max_tokens": 5.0}, "max_tokens", "got 5.0"),  # an integer, not a float that is one
        ({"max_tokens": "5"}, "max_tokens", "got '5'"),  # strict: a string is not a number
        ({"temperature": True}, "temperature", "got True"),  # nor is a bool
        ({"temperature": math.nan}, "temperature", "fit a 32-bit float"),
        ({"temperature": 1e39}, "temperature", "fit a 32-bit float"),  # float32 carries at most 3.4e38
        ({"temperature": 10**400}, "temperature", "fit a 32-bit float"),
        ({"top_p": 1e-50}, "top_p", "(0, 1]"),  # 0 once carried as a float32
        ({"seed": -1}, "seed", "[0, 2^64-1]"),
        ({"seed": 2**64}, "seed", "[0, 2^64-1]"),
        ({"priority": 2**31}, "priority", "[-2^31, 2^31-1]"),
        ({"stop": ["ok", ""]}, "stop", "empty string"),
        ({"stop": [1]}, "stop", "a string or a list of strings"),
        ({"stop": ["\udcff"]}, "stop", "not valid UTF-8"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "at most 1024"),
        ({"stop_token_ids": [True]}, "stop_token_ids", "got True in it"),
        ({"ignore_eos": 1}, "ignore_eos", "true or false"),
        ({"logprobs": 2}, "logprobs", "only the sampled token's logprob"),
        ({"n": 2}, "n", "one completion per request"),
        ({"request_id": "r" * 513}, "request_id", "more than 512"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "exceeds max_tokens (4)"),
        ({"prompt": ""}, "prompt", "must not be empty"),  # issue 35: once served from BOS alone
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": None}, "prompt", "must be given"),
        ({"prompt": "caf\udce9"}, "prompt", "not valid UTF-8"),
        ({"prompt": [1, -1]}, "prompt", "[-1] are not"),
        ({"prompt": [1, 2**32]}, "prompt", "[4294967296] are not"),
        ({"prompt": 42}, "prompt", "got 42"),
        ({"prompt": "x" * (wire.MAX_PROMPT_CHARS + 1)}, "prompt", "characters, more than"),
    ],
)
def test_refusals_name_the_field_and_say_why(values, field, words):
    exc = refused(values)
    assert exc.field == field
    assert str(exc).startswith(f"{field}: ")
    assert words in str(exc), str(exc)
    assert field_named(str(exc)) == field
    assert len(str(exc)) < 300


def test_edges_that_are_valid():
    params = validate_request(
        {
            "prompt": " \n",  # whitespace alone is a prompt
            "max_tokens": UINT32_MAX,
            "temperature": FLOAT32_MAX,
            "top_p": 1.00000001,  # 1.0 as a float32
            "top_k": -1,  # vLLM's off
            "seed": UINT64_MAX,
            "stop": "one",
            "stop_token_ids": [7] * 5000,  # one distinct id
            "priority": -(2**31),
            "logprobs": 1,
            "n": 1,
        }
    )
    assert (params.top_p, params.top_k, params.stop, len(params.stop_token_ids)) == (1.0, 0, ("one",), 5000)
    # None is the default at every door (JSON null, SamplingParams(x=None), an unset proto field).
    assert validate_request({"prompt": [1], "min_tokens": None, "stop": None}).min_tokens == 0


def test_the_first_bad_field_in_declaration_order_is_the_one_named():
    """Every door checks in the same order, so a request with several bad fields gets the same
    field named everywhere; SamplingParams' fields come first, as LLM checks them first."""
    assert refused({"prompt": "", "temperature": -1, "seed": -1}).field == "temperature"
    assert refused({"prompt": "", "min_tokens": 9, "max_tokens": 2, "seed": -1}).field == "min_tokens"
    order = list(FIELDS)
    assert order.index("prompt") > max(order.index(f) for f in SamplingParams().request_values())


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    prompt=st.one_of(
        st.text(min_size=1, max_size=8), st.lists(st.integers(0, UINT32_MAX), min_size=1, max_size=4)
    ),
    max_tokens=st.one_of(st.none(), st.integers(1, UINT32_MAX)),
    temperature=st.one_of(st.none(), st.floats(0, FLOAT32_MAX)),
    top_k=st.one_of(st.none(), st.integers(-1, INT32_MAX)),
    seed=st.one_of(st.none(), st.integers(0, UINT64_MAX)),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
    logprobs=st.sampled_from([None, 0]),
)
def test_what_passes_fits_the_wire_and_comes_back_the_same(
    prompt, max_tokens, temperature, top_k, seed, stop, logprobs
):
    values = dict(
        prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed, stop=stop,
        logprobs=logprobs,
    )  # fmt: skip
    params = validate_request(values)
    data = to_proto(params).SerializeToString()
    again = validate_request(values_from_proto(generation_pb2.GenerateRequest.FromString(data)))
    assert again == params


def test_bad_utf8_bytes_on_the_wire_are_named_as_their_field():
    ok = generation_pb2.GenerateRequest(text="fine").SerializeToString()
    bad_stop = b"\x2a\x04\x12\x02\xff\xfe"  # stopping { stop: <ff fe> }
    path = wire.bad_utf8_field(ok + bad_stop, generation_pb2.GenerateRequest.DESCRIPTOR)
    assert (path, field_of_wire_path(path)) == ("stopping.stop", "stop")
    assert field_of_wire_path("text") == field_of_wire_path("token_ids") == "prompt"
    assert wire.bad_utf8_field(ok, generation_pb2.GenerateRequest.DESCRIPTOR) is None
    assert wire.bad_utf8_field(b"\xff\xff", generation_pb2.GenerateRequest.DESCRIPTOR) is None  # corrupt


def test_make_request_and_sampling_params_refuse_what_the_wire_cannot_carry():
    with pytest.raises(InvalidRequest, match="max_tokens"):
        make_request("hi", max_tokens=2**32)  # once `ValueError: Value out of range` from protobuf
    with pytest.raises(ValueError, match="^temperature: "):
        SamplingParams(temperature="0.5")
    with pytest.raises(ValueError, match="^max_tokens: "):
        SamplingParams(max_tokens=2**40)
    assert SamplingParams(top_k=None, stop="x").stop_strings == ("x",)
    with pytest.raises(TypeError):
        check_fields({"temprature": 1})  # a door's typo is a bug, not a refusal


def run_cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--max-tokens", "-1", "hi"], "--max-tokens: must be an integer in [1, 2^32-1], got -1"),
        (["--max-tokens", "ten", "hi"], "--max-tokens: must be an integer in [1, 2^32-1], got 'ten'"),
        (["--temperature=nan", "hi"], "--temperature: must be a number >= 0 and fit a 32-bit float, got nan"),
        (["--stop-token-ids=1,x", "hi"], "--stop-token-ids: must be a list of integers in [0, 2^32-1], "
         "at most 1024 distinct, got 'x' in it"),
        ([""], "prompt: must not be empty"),
        (["caf\udce9"], "prompt: is not valid UTF-8 (a lone surrogate at character 3)"),
        (["--prompt-token-ids="], "--prompt-token-ids: must not be empty"),
        ([], "prompt: must be given"),
        (["--prompt-token-ids=1", "text"], "prompt: give it as a text or as --prompt-token-ids, not both"),
    ],
)  # fmt: skip
def test_generate_refuses_before_connecting_in_one_error_line(argv, line):
    """Nothing listens on port 1: every one of these is refused by the validation first."""
    code, err = run_cli("generate", "--port=1", "--timeout=1", *argv)
    assert code == 2, err
    assert err.splitlines()[-1] == f"pagedserve generate: error: {line}"
    assert "Traceback" not in err


# ---- every door keeps up with the table ---------------------------------------------------------

# The fields each door leaves out, and why; a new field fails these tests until each door takes it
# (or it is added here with its reason).
NOT_AT_DOOR = {
    "llm": {"prompt", "priority", "request_id"},  # generate()'s own arguments; request ids are LLM's
    "http": {"request_id"},  # the gateway makes its ids (cmpl-...)
    "cli": {"prompt", "n", "request_id"},  # the prompt is positional (or --prompt-token-ids)
    "wire": {"n"},  # one completion per request: the only value it may take is its default
}


def test_every_door_takes_every_field():
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    every = set(FIELDS)
    generate = argparse.ArgumentParser()
    cli.add_generate_args(generate)
    flags = {a.dest for a in generate._actions if a.option_strings} & every
    assert set(SamplingParams().request_values()) == every - NOT_AT_DOOR["llm"]
    assert set(CompletionRequest.model_fields) & every == every - NOT_AT_DOOR["http"]
    assert set(ChatCompletionRequest.model_fields) & every == every - NOT_AT_DOOR["http"] - {"prompt"}
    assert flags == every - NOT_AT_DOOR["cli"]
    assert {name for name, spec in FIELDS.items() if spec.wire is not None} == every - NOT_AT_DOOR["wire"]


def test_the_docs_carry_the_current_table():
    """docs/input-validation.md shows `python -m pagedserve.common.validation`'s output."""
    page = (REPO / "docs" / "input-validation.md").read_text()
    assert reference_table() in page, "regenerate the table: python -m pagedserve.common.validation"


# ---- the gateway's own forms, in-process ---------------------------------------------------------


@pytest.fixture
def app(tiny_model_dir):
    from pagedserve.entrypoints.openai.api_server import build_app
    from pagedserve.entrypoints.openai.metrics import GatewayMetrics
    from pagedserve.entrypoints.openai.schedulers import SchedulerPool
    from pagedserve.entrypoints.openai.serving import Gateway

    gateway = Gateway(SchedulerPool(["127.0.0.1:1"]), GatewayMetrics(), "tiny", str(tiny_model_dir))
    return gateway, build_app(gateway)


def test_gateway_answers_fastapi_422s_and_its_own_bugs_in_openai_shape(app, capsys):
    """FastAPI's 422 (a route with typed parameters) becomes OpenAI's 400 naming the field; a fault
    of the gateway (injected: the scheduler pool raising) is a 500 in OpenAI's shape, logged with
    its traceback; what the client sent is never a 500."""
    from fastapi.testclient import TestClient

    from pagedserve.common.logs import configure_logging

    gateway, application = app

    @application.get("/typed")
    async def typed(count: int) -> dict:
        return {"count": count}

    async def broken(request, timeout=None):
        raise RuntimeError("injected fault")

    configure_logging("test")
    with TestClient(application, raise_server_exceptions=False) as client:
        gateway.pool.generate = broken
        typed_error = client.get("/typed", params={"count": "many"})
        assert typed_error.status_code == 400
        assert typed_error.json()["error"]["param"] == "query.count"
        bug = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert bug.status_code == 500
        assert bug.json() == {
            "error": {
                "message": "internal error: RuntimeError",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
        for body in ({"prompt": "hi", "max_tokens": 2**64}, {"prompt": "", "max_tokens": 1}, {"prompt": {}}):
            refused = client.post("/v1/completions", json=body)
            assert refused.status_code == 400, refused.text
    logged = capsys.readouterr().err
    assert "unhandled error" in logged and "Traceback" in logged and "injected fault" in logged
