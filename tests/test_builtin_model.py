"""The built-in model as a quality reference: the engine's greedy tokens and prompt logprobs equal
Hugging Face's on it (float32, CPU), and `pagedserve bench --log-likelihood` scores held-out text
through the executor with HF's numbers and beats gzip."""

from __future__ import annotations

import asyncio
import gzip
import json
import math

import pytest
import torch

from pagedserve import bench
from pagedserve.bench.inprocess import InProcessTransport
from pagedserve.bench.loglik import windows
from pagedserve.common.default_model import DEFAULT_MODEL_DIR
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.runner import ModelRunner
from pagedserve.protos import executor_pb2
from pagedserve.scheduler.completion import Delta, StopConditions
from pagedserve.scheduler.engine import Engine
from pagedserve.scheduler.request import SamplingOptions
from pagedserve.scheduler.service import load_tokenizer
from pagedserve.scheduler.service_config import ServiceConfig
from tests.services import hf_greedy
from tests.toy_scheduler import ToyScheduler

MODEL = str(DEFAULT_MODEL_DIR)
PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def hf_builtin():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype="float32").eval()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def runner():
    config = ExecutorConfig(
        model=MODEL, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
        max_num_batched_tokens=512, num_gpu_blocks_override=NUM_BLOCKS, swap_space=0.001,
    )  # fmt: skip
    return ModelRunner.create(config)


def hf_token_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from HF's logits."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_engine_greedy_matches_hf_on_the_builtin_model(runner, tokenizer, hf_builtin):
    """Three prompts at once through the scheduler's Engine on the executor's runner (in-process)."""
    runner.reset()
    max_tokens = 24

    async def collect(active) -> list[int]:
        tokens: list[int] = []
        while True:
            item: Delta = await asyncio.wait_for(active.deltas.get(), 60)
            assert not isinstance(item, Exception), item
            tokens += item.token_ids
            if item.finish_reason is not None:
                return tokens

    async def scenario() -> list[list[int]]:
        transport = InProcessTransport(runner, MODEL)
        engine = Engine(ServiceConfig(model=MODEL), tokenizer, lambda _address: transport)
        task = asyncio.create_task(engine.run())
        try:
            await asyncio.wait_for(engine.wait_until_attached(), 60)
            greedy, stop = SamplingOptions(temperature=0.0), StopConditions(max_tokens=max_tokens)
            actives = [
                engine.submit(f"r{i}", tokenizer.encode(p), greedy, stop) for i, p in enumerate(PROMPTS)
            ]
            return list(await asyncio.gather(*(collect(a) for a in actives)))
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    outputs = asyncio.run(scenario())
    for prompt, got in zip(PROMPTS, outputs, strict=True):
        want = hf_greedy(hf_builtin, tokenizer.encode(prompt), max_tokens)
        assert got[: len(want)] == want, prompt  # HF stops at </s>; the engine was not told to
        assert len(want) == max_tokens or want[-1] == tokenizer.eos_token_id
        assert "\ufffd" not in tokenizer.decode(got)


def test_prompt_logprobs_match_hf_across_chunked_prefill(runner, tokenizer, hf_builtin):
    """A 40-token prompt computed in chunks of 15, 15 and 10 tokens reports each prompt token's
    logprob once, with contiguous starts; a request that did not ask gets none."""
    runner.reset()
    ids = tokenizer.encode(
        "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):"
    )
    ids = (ids * 3)[:40]
    other = tokenizer.encode("class Stack:\n    def push(self, item):")
    sched = ToyScheduler(NUM_BLOCKS, 0, runner.block_size, seed=3)
    sched.add(1, ids, executor_pb2.Sampling(return_prompt_logprobs=True))
    sched.add(2, other)
    reported: list[executor_pb2.PromptLogprobs] = []
    for num_new in ({1: 15, 2: len(other)}, {1: 15, 2: 1}, {1: 10, 2: 1}):
        output = runner.execute(sched.plan(num_new))
        sched.observe(output)
        reported += output.prompt_logprobs
    assert [(p.seq_id, p.start, len(p.logprobs)) for p in reported] == [(1, 1, 15), (1, 16, 15), (1, 31, 9)]
    got = torch.tensor([lp for p in reported for lp in p.logprobs])
    torch.testing.assert_close(got, hf_token_logprobs(hf_builtin, ids), atol=2e-4, rtol=1e-4)


def test_log_likelihood_bench_matches_hf_and_beats_gzip(runner, tokenizer, hf_builtin, tmp_path):
    """`pagedserve bench --log-likelihood` on a little held-out source: the engine's bits per byte
    are HF's over the same windows, and clearly below gzip -9's on the same bytes."""
    from pagedserve.bench.corpus import held_out_texts

    result_file = tmp_path / "loglik.json"
    argv = [
        "--log-likelihood",
        "--held-out-bytes",
        "3000",
        "--window",
        "128",
        "--result-file",
        str(result_file),
    ]
    executor = "--device cpu --dtype float32 --max-model-len 256 --num-gpu-blocks-override 64"
    assert bench.main([*argv, "--executor-args", executor]) == 0
    figures = json.loads(result_file.read_text())
    texts = held_out_texts(3000)
    data = "".join(texts).encode()
    assert figures["bytes"] == len(data)
    assert figures["builtin_model"]

    nll = 0.0
    for text in texts:
        for w in windows(tokenizer.encode(text), 128):
            nll -= float(hf_token_logprobs(hf_builtin, w).sum())
    hf_bits_per_byte = nll / math.log(2) / len(data)
    assert figures["bits_per_byte"] == pytest.approx(hf_bits_per_byte, rel=1e-4)
    gzip_bits_per_byte = len(gzip.compress(data, 9)) * 8 / len(data)
    assert figures["bits_per_byte"] < 0.75 * gzip_bits_per_byte, (figures, gzip_bits_per_byte)


def test_model_flag_is_optional_and_empty_means_the_builtin_model():
    """executor, scheduler and serve: no --model, or `--model=` (compose's `--model=${X:-}`), is the
    built-in model; pagedserve.cli.ensure_default_model() returns the same directory."""
    import argparse

    from pagedserve import cli
    from pagedserve.executor.config import add_cli_args

    executor = add_cli_args(argparse.ArgumentParser())
    scheduler = argparse.ArgumentParser()
    ServiceConfig.add_cli_args(scheduler)
    serve = argparse.ArgumentParser()
    cli.add_serve_args(serve)
    for parser in (executor, scheduler, serve):
        assert parser.parse_args([]).model == MODEL
        assert parser.parse_args(["--model="]).model == MODEL
        assert parser.parse_args(["--model=/m"]).model == "/m"
    assert cli.ensure_default_model() == DEFAULT_MODEL_DIR
    assert (DEFAULT_MODEL_DIR / "tokenizer_config.json").exists()
