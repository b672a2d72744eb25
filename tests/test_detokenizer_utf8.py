"""Streaming never emits U+FFFD for a token that only ends part of a UTF-8 character.

The tokenizer here is a byte-level BPE with so few merges that 3- and 4-byte characters (CJK,
emoji) are cut across tokens, the case where decoding each token alone yields U+FFFD.
"""

from __future__ import annotations

import random

import pytest

from pagedserve.scheduler.completion import Completion, StopConditions
from pagedserve.scheduler.detokenizer import IncrementalDetokenizer

ALPHABET = list("abc xyz\n") + list("éßż") + list("東京日本語한국어") + ["🙂", "🚀", "👍🏽", "🇫🇷"]


@pytest.fixture(scope="module")
def splitting_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,  # 256 bytes + specials + a few merges: multi-byte characters stay split
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["東京 🙂 café naïve 日本語 🚀 한국어 Straße"] * 8, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def test_tokens_do_split_characters(splitting_tokenizer):
    """The premise: some tokens decode alone to U+FFFD (else the test below would prove nothing)."""
    ids = splitting_tokenizer.encode("東京🙂🚀", add_special_tokens=False)
    assert any("\ufffd" in splitting_tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("prompt", ["", "abc ", "東京 🙂"])
def test_streamed_deltas_never_hold_a_replacement_character(splitting_tokenizer, prompt):
    for text in random_texts(60):
        prompt_ids = splitting_tokenizer.encode(prompt, add_special_tokens=False)
        ids = splitting_tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(splitting_tokenizer, prompt_ids)
        deltas = [detok.add(i) for i in ids]
        assert all("\ufffd" not in d for d in deltas), (text, deltas)
        assert detok.flush() == ""  # valid text: nothing left held back at the end
        assert "".join(deltas) == splitting_tokenizer.decode(ids) == text


def test_completion_streams_whole_characters_and_drops_a_dangling_byte(splitting_tokenizer):
    """Through the scheduler's per-request object: max_tokens ending inside a character flushes
    what the full decode has; a stop token there drops the incomplete bytes (never U+FFFD)."""
    ids = splitting_tokenizer.encode("a🙂b🚀", add_special_tokens=False)
    completion = Completion(splitting_tokenizer, [], StopConditions(max_tokens=len(ids)))
    texts = [completion.add_token(i).text for i in ids]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == "a🙂b🚀"

    rocket = splitting_tokenizer.encode("🚀", add_special_tokens=False)
    assert len(rocket) > 1
    eos = splitting_tokenizer.eos_token_id
    stop = StopConditions(max_tokens=100, stop_token_ids=frozenset({eos}))
    completion = Completion(splitting_tokenizer, [], stop)
    texts = [completion.add_token(i).text for i in [*splitting_tokenizer.encode("x"), rocket[0], eos]]
    assert "".join(texts) == "x"
    assert completion.finish_reason is not None


def test_messages_of_several_tokens_carry_whole_characters(splitting_tokenizer):
    """--stream-interval 3: the held tokens are detokenized together when their message goes, and a
    message that ends inside a character leaves its bytes to the next one."""
    ids = splitting_tokenizer.encode("a🙂b🚀c", add_special_tokens=False)
    completion = Completion(splitting_tokenizer, [], StopConditions(max_tokens=len(ids)), stream_interval=3)
    deltas = [d for i in ids if (d := completion.add_token(i)) is not None]
    assert [len(d.token_ids) for d in deltas[:-1]] == [1] + [3] * (len(deltas) - 2)
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == "a🙂b🚀c"
    assert [t for d in deltas for t in d.token_ids] == ids
