"""The sampler: greedy, top-k/top-p masks, seeded determinism, logprobs, min_tokens bans."""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor.sampler import SamplingParams, mix_seed, sample

VOCAB = 97


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(8)
    out = sample(logits, [SamplingParams()] * 8, range(8))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(16, seed=1)
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        out = sample(logits, [params] * 16, range(16))
        assert torch.equal(out.token_ids, logits.argmax(-1)), params


def test_seeded_rows_ignore_batch_composition():
    target = _logits(1, seed=2)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=99),
        SamplingParams(temperature=2.0, top_k=5),
        SamplingParams(temperature=0.5, top_p=0.5, seed=7),
    ]
    for position in range(20):
        alone = sample(target[None], [seeded], [position]).token_ids.item()
        for idx in range(len(others) + 1):  # the seeded row at every index of a varying batch
            other_logits = _logits(len(others), seed=100 + idx)
            logits = torch.cat([other_logits[:idx], target[None], other_logits[idx:]])
            params = others[:idx] + [seeded] + others[idx:]
            positions = [3, 9, 11, 40, 5][:idx] + [position] + [3, 9, 11, 40, 5][idx:]
            assert sample(logits, params, positions).token_ids[idx].item() == alone
    # The position is part of the seed: different positions draw different noise.
    assert len({sample(target[None], [seeded], [p]).token_ids.item() for p in range(64)}) > 1


def test_seed_mix_spreads():
    assert len({mix_seed(s, p) for s in range(20) for p in range(20)}) == 400
    assert all(0 <= mix_seed(2**64 - 1, p) < 2**63 for p in range(10))


def test_exponential_race_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(40000, 1)
    out = sample(logits, [SamplingParams(temperature=1.0)] * 40000, [0] * 40000)
    freq = torch.bincount(out.token_ids, minlength=4).float() / 40000
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.01, rtol=0)


def test_top_k_and_top_p_masks_hold():
    logits = _logits(1, seed=3).repeat(2000, 1)
    top5 = set(logits[0].topk(5).indices.tolist())
    out = sample(logits, [SamplingParams(temperature=3.0, top_k=5)] * 2000, [0] * 2000)
    assert set(out.token_ids.tolist()) == top5
    probs, order = logits[0].softmax(-1).sort(descending=True)
    nucleus = set(order[: int((probs.cumsum(0) < 0.8).sum()) + 1].tolist())
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 2000, [0] * 2000)
    assert set(out.token_ids.tolist()) <= nucleus
    assert len(set(out.token_ids.tolist())) > 1


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = _logits(5, seed=4)
    params = [
        SamplingParams(return_logprobs=True),
        SamplingParams(temperature=0.5, seed=1, return_logprobs=True),
    ]
    params += [SamplingParams(temperature=1.0)] * 3
    out = sample(logits, params, range(5))
    expected = logits.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)


def test_banned_ids_are_never_sampled():
    logits = _logits(300, seed=5)
    top = logits.argmax(-1)
    params = [SamplingParams(), SamplingParams(temperature=5.0)] * 150
    banned = [[t, 0, 1] for t in top.tolist()]
    out = sample(logits, params, range(300), banned)
    assert not any(t in b for t, b in zip(out.token_ids.tolist(), banned, strict=True))
    ban = SamplingParams(min_tokens=2, stop_token_ids=(2,))
    assert ban.banned_ids(1) == (2,)
    assert ban.banned_ids(2) == ()


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_k": -1}]
)
def test_invalid_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
