"""Structured outputs and tool calls as users meet them: the official `openai` client (and gRPC)
against `pagedserve serve` with 2 executors and its gateway, on the random-weight tiny model at
temperature 1.0, so that only the constraint makes the output valid. The services run with a small
KV pool and token budget, so requests are pre-empted and long prompts prefilled in chunks while
constrained requests run; one set of services serves the whole file."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import jsonschema
import openai
import pytest

from pagedserve.client import generate, make_request
from pagedserve.protos import admin_pb2, admin_pb2_grpc
from tests.services import REPO, _env, free_port, with_chat_template

pytestmark = pytest.mark.slow

# A template that declares tools as Hermes-style templates do (a system block listing them).
CHAT_TEMPLATE = (
    "{% if tools %}<s>system: tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n"
    "{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
HOT = {"temperature": 1.0}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "admin": {"type": "boolean"},
        },
        "required": ["user", "admin"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3
            },
            "level": {"enum": ["low", "high", 3]},
        },
        "required": ["tags", "level"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "score": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
            "note": {"type": ["string", "null"], "maxLength": 4},
        },
        "required": ["ratio", "score", "note"],
        "additionalProperties": False,
    },
    "refs_and_anyof": {
        "$defs": {"point": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}],
                            "items": False, "minItems": 2}},
        "type": "object",
        "properties": {
            "at": {"$ref": "#/$defs/point"}, "kind": {"anyOf": [{"const": "a"}, {"type": "null"}]}
        },
        "required": ["at", "kind"],
        "additionalProperties": False,
    },
}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                       "additionalProperties": False},
    },
}  # fmt: skip
LONG_PROMPT = "The scheduler decides which requests run. " * 6  # > the 64-token budget: chunked


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("structured") / "tiny-tools"
    return with_chat_template(tiny_model_dir, directory, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def serve(model_dir, tmp_path_factory):
    """`pagedserve serve` with 2 executors and the gateway; yields (gRPC port, gateway URL)."""
    log = tmp_path_factory.mktemp("structured-logs") / "serve.log"
    port, http_port = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model_dir), f"--port={port}",
        f"--executor-port={free_port()}", "--data-parallel-size=2", f"--openai-port={http_port}",
        "--device=cpu", "--max-num-seqs=16", "--max-num-batched-tokens=64", "--max-model-len=256",
        "--num-gpu-blocks-override=16", "--swap-space=0.01", "--preemption-mode=recompute",
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200 and _attached(port) == 2:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        yield port, url, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _executors(port: int):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return (
            admin_pb2_grpc.AdminStub(channel)
            .ListExecutors(admin_pb2.ListExecutorsRequest(), timeout=5)
            .executors
        )


def _attached(port: int) -> int:
    try:
        return sum(1 for e in _executors(port) if e.attached)
    except grpc.RpcError:
        return 0


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=f"{serve[1]}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, content="Answer:", **kwargs):
    return client.chat.completions.create(
        model="tiny-tools", messages=[{"role": "user", "content": content}], **kwargs
    )


def in_parallel(*calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_json_schemas_validate_at_temperature_one(client):
    """response_format json_schema (compact whitespace, and once vLLM's default whitespace), vLLM's
    guided_json and structured_outputs: every output parses and validates; json_object."""

    def by_response_format(name, schema, extra):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        return lambda: chat(client, response_format=fmt, max_tokens=200, extra_body=extra, **HOT)

    calls = [by_response_format(name, schema, COMPACT) for name, schema in SCHEMAS.items()]
    small = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"]}
    calls.append(by_response_format("default_whitespace", small, None))
    calls.append(
        lambda: client.completions.create(
            model="tiny-tools", prompt="x", max_tokens=200, **HOT,
            extra_body={"guided_json": SCHEMAS["nested"], **COMPACT},
        )
    )  # fmt: skip
    calls.append(
        lambda: client.completions.create(
            model="tiny-tools", prompt="y", max_tokens=200, **HOT,
            extra_body={"structured_outputs": {"json": json.dumps(SCHEMAS["bounded_numbers"]),
                                               "disable_any_whitespace": True}},
        )
    )  # fmt: skip
    json_object = {"type": "json_object"}
    calls += [
        lambda: chat(client, response_format=json_object, max_tokens=120, extra_body=COMPACT, **HOT)
    ] * 2
    results = in_parallel(*calls)
    schemas = [*SCHEMAS.values(), small, SCHEMAS["nested"], SCHEMAS["bounded_numbers"]]
    for result, schema in zip(results, schemas, strict=False):
        choice = result.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop", (text, schema)
        assert "\ufffd" not in text, text  # UTF-8 throughout (no surrogate's bytes)
        jsonschema.validate(json.loads(text), schema)  # strict JSON: no raw control characters
    # Any JSON object: its keys are free text, which a random model may not close within
    # max_tokens; an output that ends is an object, one cut short is the start of one.
    for result in results[len(schemas) :]:
        choice = result.choices[0]
        assert choice.message.content.startswith("{"), choice.message.content
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict), choice.message.content


def test_regex_choice_and_grammar(client, serve):
    grammar = (
        'root ::= pair ("," pair){0,2}\npair ::= key "=" value\nkey ::= [a-z]{1,4}\n'
        'value ::= [0-9]{1,3} | "true"'
    )
    regex = r"[A-Z][a-z]{2,5}-\d{2}"
    choices = ["yes", "no", "it depends"]

    def completion(extra):
        return lambda: client.completions.create(
            model="tiny-tools", prompt="Say:", max_tokens=40, extra_body=extra, **HOT
        )

    results = in_parallel(
        *[completion({"guided_regex": regex}) for _ in range(3)],
        *[completion({"guided_choice": choices}) for _ in range(3)],
        *[completion({"guided_grammar": grammar}) for _ in range(2)],
        completion({"structured_outputs": {"choice": choices}}),
        completion({"structured_outputs": {"regex": regex}}),
    )
    texts = [r.choices[0].text for r in results]
    assert all(r.choices[0].finish_reason == "stop" for r in results), texts
    for text in texts[:3] + texts[-1:]:
        assert re.fullmatch(regex, text), text
    assert all(t in choices for t in texts[3:6] + texts[8:9]), texts
    pair = r"[a-z]{1,4}=(?:[0-9]{1,3}|true)"
    for text in texts[6:8]:
        assert re.fullmatch(rf"{pair}(?:,{pair}){{0,2}}", text), text
    # gRPC carries the same constraint (the StructuredOutput oneof).
    with grpc.insecure_channel(f"127.0.0.1:{serve[0]}") as channel:
        out = generate(
            channel, make_request("x", max_tokens=40, temperature=1.0, structured_outputs={"choice": choices})
        )
    assert out.text in choices and out.finish_reason == "FINISH_REASON_STOP"


def _check_call(call, schemas):
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _streamed(chunks):
    """The tool calls and finish reason a stream adds up to, as OpenAI's clients add them up."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["name"] = call["name"] or (delta.function.name if delta.function else None)
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_named_and_required_tool_calls_plain_and_streamed(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    # "required" allows parallel calls, each followed by another one at will: at temperature 1 a
    # random model may go on until max_tokens, so the draws are seeded (sampling is keyed by the
    # seed and the position) to ones that end.
    kwargs = dict(tools=[WEATHER, CLOCK], max_tokens=200, extra_body=COMPACT, seed=3, **HOT)
    plain_named, plain_required, plain_one, streamed_named, streamed_required = in_parallel(
        lambda: chat(client, "Weather?", tool_choice=named, **kwargs),
        lambda: chat(client, "Weather?", tool_choice="required", **kwargs),
        lambda: chat(client, "Weather?", tool_choice="required", parallel_tool_calls=False, **kwargs),
        lambda: list(chat(client, "Weather?", tool_choice=named, stream=True, **kwargs)),
        lambda: list(chat(client, "Weather?", tool_choice="required", stream=True, **kwargs)),
    )
    for response in (plain_named, plain_required, plain_one):
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call, schemas)
    assert [c.function.name for c in plain_named.choices[0].message.tool_calls] == ["get_weather"]
    assert len(plain_one.choices[0].message.tool_calls) == 1
    for chunks, only in ((streamed_named, "get_weather"), (streamed_required, None)):
        calls, finish = _streamed(chunks)
        assert finish == "tool_calls" and calls
        for call in calls:
            assert call["id"].startswith("call_")
            assert only is None or call["name"] == only
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    # A named call's arguments stream as they are generated: several pieces.
    pieces = [c for c in streamed_named if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 1


def test_auto_tool_choice_parses_hermes_calls(client):
    """tool_choice auto: the tools reach the chat template, and a `<tool_call>` the model writes
    (forced here by a regex, as a trained model would write it) comes back as a tool call."""
    regex = (
        r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "(Paris|Oslo)", "days": [1-7]\}\}</tool_call>'
    )
    kwargs = dict(
        tools=[WEATHER], tool_choice="auto", max_tokens=120, extra_body={"guided_regex": regex}, **HOT
    )
    plain, chunks = in_parallel(
        lambda: chat(client, "Weather?", **kwargs),
        lambda: list(chat(client, "Weather?", stream=True, **kwargs)),
    )
    message = plain.choices[0].message
    assert plain.choices[0].finish_reason == "tool_calls"
    assert message.content == "Sure. "
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    calls, finish = _streamed(chunks)
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Sure. "
    # Without tools the same prompt is shorter: the template declared them.
    bare = chat(client, "Weather?", max_tokens=1)
    assert plain.usage.prompt_tokens > bare.usage.prompt_tokens


def test_constrained_requests_leave_unconstrained_greedy_outputs_unchanged(client, serve):
    """Greedy completions alone, then again beside constrained ones in the same batches, with
    chunked prefill (a prompt longer than the token budget) and pre-emption (a small KV pool), on
    both executors: the same tokens."""
    prompts = ["The quick brown fox", LONG_PROMPT, "Numbers: 0 1 2", "A block table maps"]

    def greedy(prompt):
        return lambda: client.completions.create(
            model="tiny-tools", prompt=prompt, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        ).choices[0].token_ids  # fmt: skip

    alone = [greedy(p)() for p in prompts]
    before = _preemptions(serve[0])
    constrained = [
        lambda i=i: client.completions.create(
            model="tiny-tools", prompt=LONG_PROMPT if i % 2 else "x", max_tokens=120, **HOT,
            extra_body={"guided_json": SCHEMAS["nested"], **COMPACT},
        )
        for i in range(8)
    ]  # fmt: skip
    results = in_parallel(*constrained, *[greedy(p) for p in prompts])
    assert results[len(constrained) :] == alone
    for result in results[: len(constrained)]:
        jsonschema.validate(json.loads(result.choices[0].text), SCHEMAS["nested"])
    assert _preemptions(serve[0]) > before, "the KV pool was meant to be small enough to pre-empt"
    assert all(e.requests_routed > 0 for e in _executors(serve[0]))


def _preemptions(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stats = admin_pb2_grpc.AdminStub(channel).GetStats(admin_pb2.GetSchedulerStatsRequest(), timeout=5)
    return stats.num_preemptions


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "Lookbehind"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "does not compile"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
        ({"guided_json": {"type": "string", "format": "idn-email"}}, "guided_json", "format"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "and so does guided_regex"),
        (
            {"structured_outputs": {"json": {}, "whitespace_pattern": " "}},
            "structured_outputs",
            "whitespace_pattern",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        ({"guided_choice": ["a"], "min_tokens": 2}, "guided_choice", "min_tokens"),
    ],
)
def test_constraints_that_cannot_be_enforced_are_400_naming_the_field(serve, extra, param, words):
    body = {"model": "tiny-tools", "prompt": "x", "max_tokens": 4, **extra}
    response = httpx.post(f"{serve[1]}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_bad_tools_are_400(client, serve):
    url = f"{serve[1]}/v1/chat/completions"
    base = {"model": "tiny-tools", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    unknown = {"type": "function", "function": {"name": "no"}}
    cases = [
        ({"tools": [WEATHER], "tool_choice": unknown}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
             "tool_choice": "required"},
            "tools.0.function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
    ]  # fmt: skip
    for extra, param in cases:
        response = httpx.post(url, json=base | extra, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    with grpc.insecure_channel(f"127.0.0.1:{serve[0]}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            generate(channel, make_request("x", max_tokens=4, structured_outputs={"grammar": "root ::= ("}))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("structured_outputs: grammar: does not compile")


def test_services_hold_nothing_afterwards(serve):
    deadline = time.monotonic() + 30
    while True:
        with grpc.insecure_channel(f"127.0.0.1:{serve[0]}") as channel:
            stats = admin_pb2_grpc.AdminStub(channel).GetStats(
                admin_pb2.GetSchedulerStatsRequest(), timeout=5
            )
        if stats.num_active_requests == 0 and stats.gpu_blocks_in_use == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert stats.num_active_requests == 0 and stats.gpu_blocks_in_use == 0, stats
    assert "token outside the grammar" not in Path(serve[2]).read_text()
