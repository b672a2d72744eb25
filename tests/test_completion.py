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
    """The deltas streamed for `ids` (held tokens return None: not listed)."""
    deltas = []
    for token in ids:
        if (delta := completion.add_token(token)) is not None:
            deltas.append(delta)
        if completion.finish_reason is not None:
            break
    return deltas


class CountingTokenizer:
    """The tokenizer, counting `decode` calls (the Python path of `decode_function`)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        self.calls += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


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


def test_stream_interval_holds_tokens_and_decodes_once_per_message(tokenizer):
    """Interval 4: the first token alone, then messages of 4, then the rest with the finish reason;
    the same tokens and text as interval 1, with two decodes per message instead of per token."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog again", add_special_tokens=False)
    assert len(ids) > 9
    one, four = CountingTokenizer(tokenizer), CountingTokenizer(tokenizer)
    stop = StopConditions(max_tokens=len(ids))
    per_token = run(Completion(one, [1], stop), ids)
    held = run(Completion(four, [1], stop, stream_interval=4), ids)
    sizes = [len(d.token_ids) for d in held]
    assert sizes[0] == 1 and all(n == 4 for n in sizes[1:-1]) and 1 <= sizes[-1] <= 4
    assert [t for d in held for t in d.token_ids] == ids
    assert "".join(d.text for d in held) == "".join(d.text for d in per_token)
    assert held[-1].finish_reason is FinishReason.LENGTH
    assert all(d.finish_reason is None for d in held[:-1])
    assert four.calls <= 2 * len(held) + 2 < one.calls  # + 2: the final flush


def test_stream_interval_with_stop_strings_and_abort(tokenizer):
    """Stop strings are still checked on every token (the text never contains one), and an abort
    hands over the tokens held back."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    c = Completion(tokenizer, [1], StopConditions(max_tokens=100, stop_strings=("fox j",)), stream_interval=3)
    deltas = run(c, ids)
    assert c.finish_reason is FinishReason.STOP
    assert "".join(d.text for d in deltas) == "The quick brown "

    c = Completion(tokenizer, [1], StopConditions(max_tokens=100), stream_interval=8)
    first = c.add_token(ids[0])
    assert first is not None and first.token_ids == ids[:1]
    assert all(c.add_token(t) is None for t in ids[1:4])
    last = c.abort()
    assert last.finish_reason is FinishReason.ABORT and last.token_ids == ids[1:4]
    assert first.text + last.text == tokenizer.decode(ids[:4])


def _hotpath(tiny_model_dir, *flags: str) -> str:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.hotpath", f"--model={tiny_model_dir}", "--num-requests=8",
         "--input-len=16:32", "--output-len=9", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stdout
    return result.stdout.strip().splitlines()[-1].split()[-1]  # the digest of all tokens and text


@pytest.mark.parametrize("grpc_flag", [[], ["--grpc"], ["--workload=W1-JSON"]])
def test_hotpath_bench_runs(tiny_model_dir, grpc_flag):
    """`python -m benchmarks.hotpath` stays runnable (a benchmark: nothing about speed here), with
    W1-JSON's schema too (its late masks), and through the real gRPC service messages of 4 tokens
    carry the same tokens and text as messages of one (its digest covers both)."""
    digest = _hotpath(tiny_model_dir, *grpc_flag)
    if grpc_flag:
        assert _hotpath(tiny_model_dir, *grpc_flag, "--stream-interval=4") == digest


def test_hotpath_bench_speculates_to_the_same_text(tiny_model_dir):
    """`--speculative-config`: the fake executor verifies n-gram or draft-model proposals, and
    the clients get the tokens and text they get without speculation."""
    digest = _hotpath(tiny_model_dir)
    draft = '{"method": "draft_model", "model": "draft", "num_speculative_tokens": 3}'
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    assert _hotpath(tiny_model_dir, f"--speculative-config={draft}") == digest
    assert _hotpath(tiny_model_dir, f"--speculative-config={ngram}") == digest
