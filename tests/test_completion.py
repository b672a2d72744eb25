"""Stop conditions and incremental detokenization, against the real tokenizer of the tiny model."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.completion import Completion, FinishReason, StopConditions
from pagedserve.scheduler.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(completion: Completion, ids: list[int]) -> list:
    deltas = []
    for token in ids:
        deltas.append(completion.add_token(token))
        if completion.finish_reason is not None:
            break
    return deltas


def test_detokenizer_never_emits_broken_utf8(tokenizer):
    text = "café 🙂🚀 東京 naïve Straße"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert sum(1 for p in pieces if p) > 3  # it streams, not one blob at the end


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    c = Completion(tokenizer, [1], StopConditions(max_tokens=100, stop_strings=("fox j",)))
    deltas = run(c, ids)
    assert c.finish_reason is FinishReason.STOP
    assert "".join(d.text for d in deltas) == "The quick brown "
    assert all("fox" not in d.text for d in deltas)


def test_stop_token_length_and_min_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    word = tokenizer.encode("dog", add_special_tokens=False)[0]
    c = Completion(tokenizer, [1], StopConditions(max_tokens=10, stop_token_ids=frozenset({eos})))
    deltas = run(c, [word, eos, word])
    assert c.finish_reason is FinishReason.STOP
    assert c.num_tokens == 2
    assert deltas[-1].token_ids == [eos]
    assert deltas[-1].text == ""

    c = Completion(
        tokenizer, [1], StopConditions(max_tokens=10, min_tokens=3, stop_token_ids=frozenset({eos}))
    )
    run(c, [eos, eos, eos, word])
    assert c.finish_reason is FinishReason.STOP
    assert c.num_tokens == 3  # eos ignored until min_tokens

    c = Completion(tokenizer, [1], StopConditions(max_tokens=2))
    run(c, [word] * 5)
    assert c.finish_reason is FinishReason.LENGTH
    assert c.num_tokens == 2


@pytest.mark.parametrize("grpc_flag", [[], ["--grpc"]])
def test_hotpath_bench_runs(tiny_model_dir, grpc_flag):
    """`python -m pagedserve.bench.hotpath` stays runnable (a benchmark: nothing about speed here)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.bench.hotpath", f"--model={tiny_model_dir}", "--num-requests=8",
         "--input-len=16:32", "--output-len=8", *grpc_flag],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stdout
