"""The whole path: client -> scheduler process -> executor process -> streamed tokens.

Both services run as separate processes with docker-compose.yml's commands (tests/services.py);
greedy completions must equal Hugging Face `generate` on the same model, token for token.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagedserve.client import generate, make_request, stream
from pagedserve.protos import generation_pb2, generation_pb2_grpc
from tests.services import free_port, hf_greedy, running_services, scheduler_stats, wait_for_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    with running_services(tiny_model_dir, tmp_path_factory.mktemp("logs")) as s:
        yield s


def test_concurrent_greedy_matches_hugging_face(services, hf_model):
    rng = random.Random(0)
    # 16 tokens per block: lengths end mid-block, exactly on a block, and one spans many blocks.
    lengths = [1, 7, 16, 17, 33, 50, 95, 161]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    max_tokens = 24
    with services.channel() as channel, ThreadPoolExecutor(len(prompts)) as pool:
        requests = [make_request(p, max_tokens=max_tokens, temperature=0.0) for p in prompts]
        results = list(pool.map(lambda r: generate(channel, r, timeout=120), requests))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(hf_model, prompt, max_tokens)
        assert result.usage.prompt_tokens == len(prompt)
        assert result.usage.completion_tokens == len(result.token_ids)
        assert result.finish_reason in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
        assert result.num_messages >= 2  # streamed, not sent in one piece
    assert wait_for_idle(services).gpu_blocks_in_use == 0


def test_text_prompt_streams_text(services, hf_model, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with services.channel() as channel:
        result = generate(channel, make_request("The scheduler decides", max_tokens=12, temperature=0))
        ids = (
            generation_pb2_grpc.GenerationStub(channel)
            .Tokenize(generation_pb2.TokenizeRequest(text="The scheduler decides"))
            .ids
        )
    assert result.token_ids == hf_greedy(hf_model, list(ids), 12)
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_model_info(services):
    with services.channel() as channel:
        info = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest())
    assert (info.max_model_len, info.vocab_size, info.block_size, info.eos_token_id) == (1024, 512, 16, 2)
    assert info.num_gpu_blocks > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt=[]), "empty"),
        (dict(prompt=""), "empty"),
        (dict(prompt=[5] * 1025), "max_model_len"),
        (dict(prompt=[5] * 1000, max_tokens=100), "exceeds max_model_len"),
        (dict(prompt=[5] * 1024), "no room"),
        (dict(prompt=[5, 512]), "outside the vocabulary"),
        (dict(prompt=[5], temperature=-0.5), "temperature"),
        (dict(prompt=[5], top_p=0.0), "top_p"),
        (dict(prompt=[5], top_p=1.5), "top_p"),
        (dict(prompt=[5], top_k=-2), "top_k"),
        (dict(prompt=[5], max_tokens=0), "max_tokens"),
        (dict(prompt=[5], max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(prompt=[5], stop_token_ids=[9999]), "stop_token_ids"),
    ],
)
def test_invalid_requests_get_invalid_argument(services, kwargs, message):
    """Sent as a raw client would: make_request itself refuses what needs no model."""
    prompt = kwargs.pop("prompt")
    sampling = {k: kwargs.pop(k) for k in ("temperature", "top_p", "top_k") if k in kwargs}
    request = generation_pb2.GenerateRequest(
        sampling=generation_pb2.SamplingParams(**sampling), stopping=generation_pb2.StoppingCriteria(**kwargs)
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(prompt)
    with services.channel() as channel, pytest.raises(grpc.RpcError) as err:
        generate(channel, request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


@pytest.mark.parametrize("method", ["Generate", "Tokenize", "GetModelInfo"])
def test_malformed_request_bytes_get_invalid_argument(services, method):
    with services.channel() as channel, pytest.raises(grpc.RpcError) as err:
        call = channel.unary_stream if method == "Generate" else channel.unary_unary
        response = call(f"/pagedserve.v1.Generation/{method}", request_serializer=bytes)(
            b"\xff\xff", timeout=30
        )
        list(response) if method == "Generate" else response
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in err.value.details()


def test_cancelled_stream_frees_its_blocks(services):
    with services.channel() as channel:
        responses = stream(channel, make_request([7] * 40, max_tokens=900, ignore_eos=True, temperature=0))
        for _, _ in zip(range(3), responses, strict=False):
            pass
        assert scheduler_stats(services).gpu_blocks_in_use > 0
        responses.cancel()
    stats = wait_for_idle(services)
    assert stats.gpu_blocks_in_use == 0
    assert stats.num_active_requests == 0


def test_stop_string_ends_the_text_before_it(services):
    prompt = [11, 12, 13, 14]
    with services.channel() as channel:
        full = generate(channel, make_request(prompt, max_tokens=40, temperature=0, ignore_eos=True))
        assert len(full.text) > 12
        stop = full.text[6:9]
        first = full.text.index(stop)
        cut = generate(
            channel, make_request(prompt, max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
        )
    assert cut.finish_reason == "FINISH_REASON_STOP"
    assert cut.text == full.text[:first]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_seeded_sampling_repeats_and_logprobs(services):
    def sample(seed: int, channel) -> list[int]:
        r = make_request(
            [20, 21, 22], max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True, return_logprobs=True
        )
        result = generate(channel, r)
        assert len(result.logprobs) == len(result.token_ids)
        assert all(lp <= 0 for lp in result.logprobs)
        return result.token_ids

    with services.channel() as channel, ThreadPoolExecutor(4) as pool:
        # Same seed alone and beside other requests: the same tokens.
        alone = sample(1234, channel)
        crowded = list(pool.map(lambda s: sample(s, channel), [1234, 99, 1234, 7]))
    assert crowded[0] == alone
    assert crowded[2] == alone
    assert crowded[1] != alone


def test_unavailable_without_executor(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    port = free_port()
    cmd = [
        sys.executable, "-m", "pagedserve.scheduler", f"--model={tiny_model_dir}", f"--port={port}",
        f"--executor=127.0.0.1:{free_port()}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            with pytest.raises(grpc.RpcError) as err:
                generate(channel, make_request([5, 6], max_tokens=2), timeout=30)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "executor" in err.value.details()
