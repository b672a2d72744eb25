"""The OpenAI-compatible gateway as a user meets it: the official `openai` client against a real
gateway process in front of real scheduler + executor processes (CPU, the tiny model with a chat
template added)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.client import generate, make_request
from tests.services import (
    REPO,
    _env,
    free_port,
    running_services,
    scheduler_stats,
    wait_for_idle,
    with_chat_template,
)

pytestmark = pytest.mark.slow

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@contextlib.contextmanager
def running_gateway(log: Path, *args: str) -> Iterator[str]:
    """`pagedserve openai ARGS` as a process; yields its base URL once it answers HTTP."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "openai", f"--port={port}", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                httpx.get(f"{url}/metrics", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, its tokenizer given a chat template (it has none)."""
    return with_chat_template(tiny_model_dir, tmp_path_factory.mktemp("chat") / "tiny-chat", CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def stack(chat_model_dir, tmp_path_factory):
    """Executor + scheduler + gateway; yields (services, gateway URL)."""
    logs = tmp_path_factory.mktemp("gateway-logs")
    executor_args = ("--num-gpu-blocks-override=128", "--swap-space=0.01")
    with running_services(chat_model_dir, logs, executor_args=executor_args) as services:
        with running_gateway(logs / "gateway.log", f"--scheduler=127.0.0.1:{services.port}") as url:
            yield services, url


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack[1]}/v1", api_key="unused", max_retries=0)


def test_models_health_and_metrics(stack, client):
    _, url = stack
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    assert httpx.get(f"{url}/health").status_code == 200
    client.completions.create(model="tiny-chat", prompt="x", max_tokens=2)
    metrics = httpx.get(f"{url}/metrics").text
    assert 'pagedserve_gateway_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert "pagedserve_gateway_time_to_first_token_seconds_bucket" in metrics


def test_completions_plain_and_streamed_equal_grpc(stack, client):
    services, _ = stack
    prompt = "The scheduler decides"
    plain = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, **GREEDY)
    chunks = list(
        client.completions.create(
            model="tiny-chat", prompt=prompt, max_tokens=12, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    with services.channel() as channel:
        direct = generate(channel, make_request(prompt, max_tokens=12, temperature=0, ignore_eos=True))
    assert plain.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices) == direct.text
    assert plain.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert plain.usage.prompt_tokens == direct.usage.prompt_tokens
    assert plain.usage.completion_tokens == 12
    assert plain.usage.total_tokens == direct.usage.prompt_tokens + 12
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # Token ids as the prompt, and the sampled token's logprobs.
    ids = client.completions.create(
        model="tiny-chat", prompt=[7, 8, 9, 10], max_tokens=4, logprobs=1, **GREEDY
    ).choices[0]
    assert len(ids.logprobs.token_logprobs) == len(ids.logprobs.tokens) == 4


def test_chat_plain_and_streamed_equal_grpc(stack, client, chat_model_dir):
    from transformers import AutoTokenizer

    services, _ = stack
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block?"}]
    plain = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_completion_tokens=10, **GREEDY
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-chat", messages=messages, max_tokens=10, stream=True,
            stream_options={"include_usage": True}, logprobs=True, **GREEDY,
        )
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    with services.channel() as channel:
        direct = generate(channel, make_request(ids, max_tokens=10, temperature=0, ignore_eos=True))
    content = plain.choices[0].message.content
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].finish_reason == "length"
    assert content == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert plain.usage.prompt_tokens == len(ids)
    assert plain.usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].choices == []
    streamed_logprobs = [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content
    ]
    assert len(streamed_logprobs) == 10
    assert all(lp.logprob <= 0 for lp in streamed_logprobs)


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"temperature": -1}, "temperature", "must be a number >= 0"),
        ({"n": 2}, "n", "must be 1 (one completion per request is supported)"),
        ({"max_tokens": 5000}, "max_tokens", "max_model_len"),  # the scheduler's INVALID_ARGUMENT
        ({"extra_body": {"stop_token_ids": [99999]}}, "stop_token_ids", "vocabulary"),
        ({"extra_body": {"top_k": -5}}, "top_k", "must be an integer in [-1, 2^31-1]"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ],
)
def test_bad_requests_are_400_naming_the_field(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-chat", prompt="hello", **kwargs)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["param"] == param
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_unknown_model_is_404_and_chat_shape_errors_are_400(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hello")
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-chat", messages=[])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}], n=2)
    assert info.value.body["param"] == "n"


def test_no_scheduler_is_503_and_no_chat_template_is_400(tiny_model_dir, tmp_path):
    """A gateway whose scheduler is down; its tokenizer (the plain tiny model's) has no template."""
    dead = f"127.0.0.1:{free_port()}"
    args = (f"--scheduler={dead}", "--served-model-name=tiny", f"--tokenizer={tiny_model_dir}")
    with running_gateway(tmp_path / "gateway.log", *args) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert info.value.status_code == 503
        assert "no scheduler is serving" in info.value.body["message"]
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="hello", max_tokens=2, stream=True)
        assert info.value.status_code == 503
        assert httpx.get(f"{url}/health").status_code == 503
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert "no chat template" in info.value.body["message"]
        assert info.value.body["param"] == "messages"


def test_round_robin_skips_a_scheduler_that_is_down(stack, tmp_path):
    """Two --scheduler addresses, one with nothing behind it: every request is served (the dead
    one is tried first for half of them, answers UNAVAILABLE, and the next one takes the request)."""
    services, _ = stack
    dead = f"127.0.0.1:{free_port()}"
    args = (f"--scheduler={dead}", f"--scheduler=127.0.0.1:{services.port}")
    with running_gateway(tmp_path / "gateway.log", *args) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert httpx.get(f"{url}/health").status_code == 200
        for _ in range(4):
            assert (
                client.completions.create(model="tiny-chat", prompt="hi", max_tokens=2)
                .choices[0]
                .finish_reason
            )


def test_client_disconnect_cancels_the_request_and_frees_its_blocks(stack):
    """A streamed and a non-streamed request dropped by their clients: the scheduler holds no block
    and no request afterwards, and neither ran to its max_tokens."""
    services, url = stack
    body = {"model": "tiny-chat", "prompt": "The quick brown fox", "max_tokens": 1000, "ignore_eos": True}
    before = scheduler_stats(services).tokens_generated
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
    stats = wait_for_idle(services)
    assert stats.gpu_blocks_in_use == 0
    assert stats.num_active_requests == 0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    stats = wait_for_idle(services)
    assert stats.gpu_blocks_in_use == 0
    assert stats.num_active_requests == 0
    assert stats.tokens_generated - before < 2000


def test_serve_openai_port_starts_the_gateway_in_front_of_its_scheduler():
    from pagedserve import cli as pagedserve_cli

    parser = argparse.ArgumentParser()
    pagedserve_cli.add_serve_args(parser)
    args = parser.parse_args(["--model", "m", "--port", "6000", "--openai-port", "8123"])
    children = pagedserve_cli.serve_children(args, Path("m"))
    gateway = list(children[-1].argv)
    assert children[-1].name == "openai"
    assert children[-1].restart
    assert gateway[1:3] == ["-m", "pagedserve.entrypoints.openai"]
    assert gateway[gateway.index("--port") + 1] == "8123"
    assert gateway[gateway.index("--scheduler") + 1] == "127.0.0.1:6000"
    assert pagedserve_cli.openai_gateway_command(parser.parse_args(["--model", "m"]), Path("m")) is None


def test_bench_compare_openai_runs_the_same_requests_through_the_gateway(tiny_model_dir, tmp_path, capsys):
    """`pagedserve bench --launch --compare-openai` (the GPU measurement of issue 15) on the CPU:
    gRPC, then through two launched gateways (two client processes, one on each) streamed and not;
    greedy outputs identical in all three, request by request."""
    import json

    from pagedserve import bench

    result = tmp_path / "bench.json"
    cpu = "--device cpu --dtype float32 --num-gpu-blocks-override 128 --swap-space 0.01"
    argv = ["--launch", "--model", str(tiny_model_dir), "--compare-openai", "--num-prompts", "6",
            "--input-len", "8:40", "--output-len", "4:12", "--no-plot", "--result-file", str(result),
            "--executor-args", cpu, "--openai-client-processes", "2", "--openai-gateways", "2"]  # fmt: skip
    assert bench.main(argv) == 0
    report = json.loads(result.read_text())
    assert [r["completed"] for r in report["runs"]] == [6, 6, 6]
    comparison = report["comparison"]
    assert comparison["greedy outputs identical (stream)"]
    assert comparison["greedy outputs identical (plain)"]
    assert comparison["greedy requests identical (stream)"] == "6 / 6 (100.0%)"
    assert all(r["identical_to_grpc"] for run in report["runs"][1:] for r in run["requests"])
    assert report["config"]["openai_client_processes"] == 2
    assert comparison["gateway CPU (s), stream"] > 0  # the two launched gateways' CPU over the pass
    assert (tmp_path / "logs" / "gateway-1.log").exists()
    assert "gateway cost, stream (1 - openai/gRPC)" in capsys.readouterr().out
