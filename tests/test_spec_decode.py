"""Speculative decoding's parts without services: the n-gram proposer, the config's validation, the
scheduler's slots for proposals (reserved, trimmed, never registered in the prefix cache while they
are not accepted), disable_by_batch_size, and the acceptance rules' output distribution (chi-square
over many draws with fixed seeds)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from pagedserve.common.ngram import propose_ngram
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.executor.sampler import SamplingParams
from pagedserve.executor.spec_decode import (
    VerifyLayout,
    accept_greedy,
    processed_probs,
    verify_draft_model,
    verify_point_mass,
)
from pagedserve.scheduler.block_pool import hash_block_tokens
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.core import Scheduler
from pagedserve.scheduler.request import Request, SamplingOptions, SeqId
from tests.services import hf_greedy

NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_max=3, prompt_lookup_min=1)

# ---- the n-gram proposer ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 4, 1, 2], 2, [3, 4]),  # the 2-gram (1, 2) occurred at 0: what followed it
        ([1, 2, 3, 4, 1, 2], 5, [3, 4, 1, 2]),  # up to k tokens, as many as there are
        ([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], 1, [9]),  # the first occurrence of the longest match
        ([1, 2, 3, 9, 2, 3], 3, [9, 2, 3]),  # (2, 3) matched (3-gram (9, 2, 3) did not)
        ([1, 2, 3, 4], 3, []),  # no n-gram of length >= 1 repeats
        ([7], 3, []),
        ([4, 4, 4], 2, [4]),  # the 3-gram is the whole sequence; (4, 4) at 0, then one token
    ],
)
def test_ngram_proposes_what_followed_the_longest_earlier_match(tokens, k, expected):
    assert propose_ngram(tokens, k, lookup_min=1, lookup_max=3) == expected


def test_ngram_search_equals_comparing_every_window():
    """The search that checks only positions holding the last token finds what comparing every
    earlier window with the suffix finds (random short sequences over 4 tokens: many matches)."""
    from numpy.lib.stride_tricks import sliding_window_view

    def every_window(ids: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
        for n in range(min(hi, len(ids) - 1), lo - 1, -1):
            hits = np.flatnonzero((sliding_window_view(ids[:-1], n) == ids[len(ids) - n :]).all(axis=1))
            if len(hits):
                return ids[int(hits[0]) + n :][:k].tolist()
        return []

    rng = random.Random(0)
    for _ in range(2000):
        ids = np.array([rng.randrange(4) for _ in range(rng.randrange(1, 50))])
        lo = rng.randrange(1, 4)
        hi, k = rng.randrange(lo, 6), rng.randrange(1, 5)
        assert propose_ngram(ids, k, lo, hi) == every_window(ids, k, lo, hi), (ids.tolist(), k, lo, hi)


def test_ngram_proposer_keeps_each_requests_tokens_as_they_arrive():
    from pagedserve.scheduler.ngram import NgramProposer

    proposer = NgramProposer(lookup_min=1, lookup_max=2)
    request = Request(SeqId(1), [1, 2, 3], max_tokens=200)
    assert proposer.propose(request, 2) == []
    request.output_token_ids += [1]
    assert proposer.propose(request, 2) == [2, 3]
    request.output_token_ids += list(range(10, 150)) + [10]  # grows past its first buffer
    assert proposer.propose(request, 3) == [11, 12, 13]
    proposer.forget(request.seq_id)
    assert proposer.propose(request, 1) == [11]


def test_ngram_lookup_min_bounds_the_match():
    assert propose_ngram([1, 2, 3, 4, 9, 4], 2, lookup_min=2, lookup_max=3) == []
    assert propose_ngram([1, 2, 3, 4, 9, 4], 2, lookup_min=1, lookup_max=3) == [9, 4]


# ---- the config ---------------------------------------------------------------------------------


NG = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
DM = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}
FIELD = "speculative_config."


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, FIELD + "method: must be one of"),
        ({"method": "ngram", "prompt_lookup_max": 2}, FIELD + "num_speculative_tokens: required"),
        (
            NG | {"num_speculative_tokens": 0},
            FIELD + "num_speculative_tokens: must be an integer in [1, 16], got 0",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2},
            FIELD + "prompt_lookup_max: the ngram method needs it",
        ),
        (
            NG | {"prompt_lookup_min": 3},
            FIELD + "prompt_lookup_min: must be an integer in [1, 2] (<= prompt_lookup_max), got 3",
        ),
        (
            {"method": "draft_model", "num_speculative_tokens": 2},
            FIELD + "model: the draft_model method needs",
        ),
        (DM | {"prompt_lookup_max": 2}, FIELD + "prompt_lookup_max: not a field of the draft_model method"),
        (NG | {"disable_by_batch_size": 0}, FIELD + "disable_by_batch_size: must be an integer"),
        (NG | {"num_speculative_tokens": "2"}, "got '2'"),
        ("[1]", "speculative_config: must be a JSON object"),
        ("{method", "speculative_config: not JSON"),
    ],
)
def test_bad_configs_name_the_field(value, message):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.parse(value)
    assert message in str(err.value)


def test_config_round_trips_and_defaults_lookup_min():
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert spec.prompt_lookup_min == 1
    assert SpeculativeConfig.parse(spec.to_json()) == spec


# ---- the scheduler: slots for proposals ---------------------------------------------------------


def _scheduler(spec: SpeculativeConfig | None = NGRAM, num_blocks: int = 64, **kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(block_size=4, num_gpu_blocks=num_blocks, max_model_len=256, speculative=spec, **kw)
    )


def _registered_blocks_hold_known_tokens(sched: Scheduler, request: Request) -> int:
    """Every block of the request registered in the prefix cache carries the hash of the tokens
    the request really has at its positions (accepted ones only). Returns how many were checked."""
    manager = sched.kv_cache_manager
    tokens = request.all_token_ids
    parent, checked = None, 0
    for index, block in enumerate(manager.blocks(request.seq_id)):
        chunk = tokens[index * 4 : (index + 1) * 4]
        if len(chunk) < 4:
            assert block.block_hash is None
            break
        parent = hash_block_tokens(parent, chunk)
        if block.block_hash is not None:
            assert block.block_hash == parent, (index, chunk)
            checked += 1
    return checked


def test_proposals_get_slots_and_the_rejected_ones_give_them_back():
    sched = _scheduler()
    request = Request(SeqId(1), [1, 2, 3, 1, 2, 3], max_tokens=40, sampling=SamplingOptions(temperature=0))
    sched.add_request(request)
    plan = sched.schedule()
    assert plan.sampling_seq_ids == [1]
    sched.process_output(plan.step_id, [1], [1])  # known: 1 2 3 1 2 3 1
    plan = sched.schedule()
    (running,) = plan.running
    assert running.draft_token_ids == [2, 3, 1]  # what followed the first (2, 3, 1)
    assert running.num_new_tokens == 4 and running.num_draft_tokens == 3
    assert request.num_computed_tokens == 10
    assert len(sched.kv_cache_manager.block_ids(request.seq_id)) == 3  # 10 slots
    assert sched.schedule().is_empty  # nothing else while its output is pending
    sched.process_output(plan.step_id, [1], [7], [1])  # every proposal rejected: the correction 7
    assert request.output_token_ids == [1, 7]
    assert request.num_computed_tokens == 7 and request.num_tokens == 8
    assert len(sched.kv_cache_manager.block_ids(request.seq_id)) == 2  # trimmed to position 7
    assert sched.stats.spec_draft_tokens == 3 and sched.stats.spec_accepted_tokens == 0
    plan = sched.schedule()
    (running,) = plan.running
    # known: 1 2 3 1 2 3 1 7: no earlier 7, (1, 7) and (3, 1, 7) neither
    assert running.num_draft_tokens == 0 and running.num_new_tokens == 1


def test_accepted_run_advances_by_its_length_and_max_tokens_caps_proposals():
    sched = _scheduler()
    request = Request(SeqId(1), [5, 6, 7, 8, 5, 6], max_tokens=4, sampling=SamplingOptions(temperature=0))
    sched.add_request(request)
    sched.process_output(sched.schedule().step_id, [1], [7])  # known 5 6 7 8 5 6 7
    plan = sched.schedule()
    (running,) = plan.running
    assert running.draft_token_ids == [8, 5]  # 1 output so far: at most 4 - 1 - 1 proposals
    sched.process_output(plan.step_id, [1], [8, 5, 6], [3])  # both accepted, then the bonus 6
    assert request.output_token_ids == [7, 8, 5, 6]
    assert sched.get_request(SeqId(1)) is None  # max_tokens reached inside the run
    assert sched.kv_cache_manager.block_pool.num_blocks_in_use == 0
    assert sched.stats.spec_accepted_per_pos == (1, 1, 0, 0)


def test_a_draft_model_verification_holds_the_next_ones_slots_where_they_fit():
    """With a draft model a verification also allocates the next verification's k + 1 slots and
    keeps them through the trim (the executor launches that step before its plan), but only where
    every running request can still grow by a block: a reservation never pre-empts anyone."""
    spec = SpeculativeConfig("draft_model", 3, model="d")  # lookahead: 4 slots, one 4-token block
    sched = _scheduler(spec)
    request = Request(SeqId(1), [1, 2, 3, 4, 5], max_tokens=20, sampling=SamplingOptions(temperature=0))
    sched.add_request(request)
    sched.process_output(sched.schedule().step_id, [1], [6])
    plan = sched.schedule()
    (running,) = plan.running
    assert running.num_draft_tokens == 3 and request.num_computed_tokens == 9
    assert len(sched.kv_cache_manager.block_ids(request.seq_id)) == 4  # 9 slots and 4 more: 13
    sched.process_output(plan.step_id, [1], [7, 8], [2])  # one accepted, then the bonus
    assert request.num_computed_tokens == 7
    assert len(sched.kv_cache_manager.block_ids(request.seq_id)) == 3  # 7 computed and 4 ahead: 11

    # Two requests in a pool of 6 blocks, 2 free: both verifications' own slots fit (a block each),
    # the first one's reservation too, but then the second would have to pre-empt.
    sched = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=6, max_model_len=24, speculative=spec))
    requests = [
        Request(SeqId(i), [i, 2, 3, 4, 5], max_tokens=12, sampling=SamplingOptions(temperature=0))
        for i in (1, 2)
    ]
    for request in requests:
        sched.add_request(request)
    sched.process_output(sched.schedule().step_id, [1, 2], [6, 6])
    plan = sched.schedule()
    assert [p.num_draft_tokens for p in plan.running] == [3, 3]
    assert [len(sched.kv_cache_manager.block_ids(r.seq_id)) for r in requests] == [3, 3]
    assert sched.stats.num_preemptions == 0


def test_no_registered_block_ever_holds_a_rejected_token():
    """Random acceptance over many steps, with prefix caching, for several requests at once: after
    every output each registered block hashes the request's real tokens; all blocks come back."""
    rng = random.Random(0)
    sched = _scheduler(num_blocks=128)
    requests = []
    for i in range(4):
        prompt = [rng.randrange(1, 6) for _ in range(rng.randrange(3, 12))]
        requests.append(Request(SeqId(i), prompt, max_tokens=60, sampling=SamplingOptions(temperature=0)))
        sched.add_request(requests[-1])
    checked = 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        drafts = {p.seq_id: p for p in plan.running}
        seq_ids, tokens, counts = [], [], []
        for seq_id in plan.sampling_seq_ids:
            proposed = drafts[seq_id].draft_token_ids if seq_id in drafts else []
            accepted = rng.randrange(len(proposed) + 1)
            # Accepted proposals, then a token that differs from the next proposal (or any bonus).
            nxt = proposed[accepted] if accepted < len(proposed) else None
            run = proposed[:accepted] + [rng.choice([t for t in range(1, 6) if t != nxt])]
            seq_ids.append(seq_id)
            tokens += run
            counts.append(len(run))
        sched.process_output(plan.step_id, seq_ids, tokens, counts)
        for request in requests:
            if sched.get_request(request.seq_id) is not None:
                checked += _registered_blocks_hold_known_tokens(sched, request)
    assert checked > 20
    assert sched.stats.spec_accepted_tokens > 0
    assert sched.kv_cache_manager.block_pool.num_blocks_in_use == 0


def test_only_copying_requests_wait_for_their_output():
    """With n-gram proposals, a request whose tokens end in no n-gram seen before stays in every
    plan (pipelined, no proposals); one that is copying waits for its output to get proposals."""
    sched = _scheduler()
    fresh = Request(SeqId(1), [1, 2, 3, 4, 5], max_tokens=20)
    copying = Request(SeqId(2), [7, 8, 9, 7, 8], max_tokens=20)
    sched.add_request(fresh)
    sched.add_request(copying)
    plan = sched.schedule()
    sched.process_output(plan.step_id, [1, 2], [6, 9])  # 1: ... 5 6 (new); 2: ... 7 8 9 (copying)
    plan = sched.schedule()
    assert {p.seq_id: p.draft_token_ids for p in plan.running} == {1: [], 2: [7, 8, 9]}
    ahead = sched.schedule()  # both outputs pending: only the fresh request is planned ahead
    assert [p.seq_id for p in ahead.running] == [1]


def test_disable_by_batch_size_turns_proposals_off_above_it():
    spec = SpeculativeConfig("ngram", 2, prompt_lookup_max=2, prompt_lookup_min=1, disable_by_batch_size=1)
    sched = _scheduler(spec)
    for i in range(2):
        sched.add_request(Request(SeqId(i), [1, 2, 1, 2, 1], max_tokens=20))
    plan = sched.schedule()
    sched.process_output(plan.step_id, [0, 1], [2, 2])
    plan = sched.schedule()  # two running: no proposals, and the pipeline stays full
    assert [p.num_draft_tokens for p in plan.running] == [0, 0]
    assert not sched.schedule().is_empty  # planned ahead while outputs are pending
    sched.abort_request(SeqId(1))
    sched.process_output(plan.step_id, [0, 1], [1, 1])
    sched.process_output(plan.step_id + 1, [0], [2])
    plan = sched.schedule()  # one running: it speculates
    assert [p.num_draft_tokens for p in plan.running] == [2]


# ---- acceptance: the output distribution is the target's ----------------------------------------

VOCAB, DRAWS = 8, 40_000
# Critical chi-square values at p = 1e-4 (fixed seeds: the test is deterministic; the margin keeps
# it meaningful under any RNG change).
CHI2_CRIT = {7: 29.9, 4: 23.5}


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _target(params: SamplingParams) -> tuple[torch.Tensor, np.ndarray]:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8]])
    return logits, processed_probs(logits, [params])[0].numpy().astype(np.float64)


@pytest.mark.parametrize(
    ("params", "dof"), [(SamplingParams(temperature=1.0), 7), (SamplingParams(temperature=0.7, top_k=5), 4)]
)
def test_point_mass_acceptance_emits_the_target_distribution(params, dof):
    """One proposal per sequence (a point mass on token 1, the second most likely): the first
    emitted token must be distributed as p, with temperature and top-k applied as the sampler does,
    and the proposal accepted with probability p(1)."""
    torch.manual_seed(1)
    logits, p = _target(params)
    layout = VerifyLayout(np.ones(DRAWS, dtype=np.int64), np.arange(DRAWS, dtype=np.int64) * 2)
    rows = logits.repeat(2 * DRAWS, 1)
    drafts = torch.tensor([1, -1] * DRAWS)
    out = verify_point_mass(rows, drafts, [params] * DRAWS, [10] * DRAWS, layout)
    first = out.token_ids[:, 0].numpy()
    counts = np.bincount(first, minlength=VOCAB)
    assert _chi2(counts, p) < CHI2_CRIT[dof]
    accepted = (out.counts == 2).float().mean().item()
    assert abs(accepted - p[1]) < 4 * np.sqrt(p[1] * (1 - p[1]) / DRAWS)
    # After an accepted proposal the bonus is a fresh draw from p.
    bonus = out.token_ids[out.counts == 2, 1].numpy()
    assert _chi2(np.bincount(bonus, minlength=VOCAB), p) < CHI2_CRIT[dof]


@pytest.mark.parametrize(
    ("params", "dof"), [(SamplingParams(temperature=1.0), 7), (SamplingParams(temperature=0.7, top_k=5), 4)]
)
def test_draft_model_acceptance_emits_the_target_distribution(params, dof):
    """Proposals drawn from a draft distribution q unlike p: min(1, p/q) acceptance and the
    residual make the first emitted token distributed as p; acceptance is sum(min(p, q))."""
    torch.manual_seed(2)
    _, p = _target(params)
    logits = _target(params)[0]
    q = torch.tensor([0.05, 0.1, 0.3, 0.2, 0.1, 0.1, 0.05, 0.1])
    layout = VerifyLayout(np.ones(DRAWS, dtype=np.int64), np.arange(DRAWS, dtype=np.int64) * 2)
    drafted = torch.multinomial(q, DRAWS, replacement=True)
    drafts = torch.stack([drafted, torch.full_like(drafted, -1)], dim=1).reshape(-1)
    rows = logits.repeat(2 * DRAWS, 1)
    out = verify_draft_model(rows, drafts, q.repeat(2 * DRAWS, 1), [params] * DRAWS, [10] * DRAWS, layout)
    counts = np.bincount(out.token_ids[:, 0].numpy(), minlength=VOCAB)
    assert _chi2(counts, p) < CHI2_CRIT[dof]
    accept = np.minimum(p, q.numpy()).sum()
    rate = (out.counts == 2).float().mean().item()
    assert abs(rate - accept) < 4 * np.sqrt(accept * (1 - accept) / DRAWS)


def test_greedy_acceptance_is_argmax_matching():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    layout = VerifyLayout(np.array([3]), np.array([0]))
    greedy = SamplingParams(temperature=0)
    out = verify_point_mass(logits, torch.tensor([1, 0, 1, -1]), [greedy], [4], layout)
    assert out.counts.tolist() == [3]  # 1 and 0 accepted, 1 rejected: the argmax 2 instead
    assert out.token_ids[0, :3].tolist() == [1, 0, 2] and out.last_token.tolist() == [2]
    q = torch.full((4, 3), 1 / 3)
    out = verify_draft_model(logits, torch.tensor([1, 0, 2, -1]), q, [greedy], [4], layout)
    assert out.counts.tolist() == [4] and out.token_ids[0].tolist() == [1, 0, 2, 0]


def test_graphable_greedy_acceptance_equals_the_general_rule():
    """`accept_greedy` (fixed shapes, for the acceptance graphs) emits what `verify_point_mass`
    emits for greedy rows, over many random proposal runs, every one rejected at some position
    or none."""
    torch.manual_seed(4)
    num, k, vocab = 64, 4, 6  # a small vocabulary: many proposals right
    logits = torch.randn(num * (k + 1), vocab)
    proposals = torch.randint(0, vocab, (num, k))
    proposals[::3] = logits.argmax(dim=-1).view(num, k + 1)[::3, :k]  # every third one all right
    tokens, counts, last = accept_greedy(logits, proposals)
    layout = VerifyLayout(np.full(num, k), np.arange(num) * (k + 1))
    rows = torch.cat([proposals, torch.full((num, 1), -1)], dim=1).reshape(-1)
    want = verify_point_mass(logits, rows, [SamplingParams(temperature=0)] * num, [9] * num, layout)
    assert counts.tolist() == want.counts.tolist() and last.tolist() == want.last_token.tolist()
    for i, count in enumerate(counts.tolist()):
        assert tokens[i, :count].tolist() == want.token_ids[i, :count].tolist()
    assert counts[::3].tolist() == [k + 1] * len(counts[::3]) and 1 in counts.tolist()


def test_seeded_point_mass_verification_repeats_the_samplers_tokens():
    """A seeded row draws the sampler's per-(seed, position) noise, so what it emits is what the
    sampler alone emits at those positions: the same tokens with and without speculation."""
    from pagedserve.executor.sampler import sample

    torch.manual_seed(3)
    logits = torch.randn(5, 50)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = sample(logits, [params] * 5, list(range(20, 25))).token_ids
    drafts = alone.clone()
    drafts[2] = (drafts[2] + 1) % 50  # the third proposal is wrong
    drafts[4] = -1
    out = verify_point_mass(logits, drafts, [params], [20], VerifyLayout(np.array([4]), np.array([0])))
    assert out.counts.tolist() == [3]
    assert out.token_ids[0, :3].tolist() == alone[:3].tolist()


def test_metrics_expose_vllms_spec_decode_counters():
    from dataclasses import fields
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from pagedserve.scheduler.core import SchedulerStats
    from pagedserve.scheduler.metrics import SchedulerMetrics

    values = {f.name: 0 for f in fields(SchedulerStats)}
    values |= dict(
        spec_steps=10, spec_draft_tokens=40, spec_accepted_tokens=25, spec_accepted_per_pos=(9, 7, 5, 4)
    )
    engine = SimpleNamespace(core_stats=lambda: SchedulerStats(**values), executor_statuses=lambda: [])
    text = generate_latest(SchedulerMetrics(engine, "m").registry).decode()  # type: ignore[arg-type]
    for line in (
        'pagedserve:spec_decode_num_drafts_total{model_name="m"} 10.0',
        'pagedserve:spec_decode_num_draft_tokens_total{model_name="m"} 40.0',
        'pagedserve:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0',
        'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0',
        'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 4.0',
    ):
        assert line in text, line


# ---- the executor: verification steps through the graphs' padded layouts ------------------------

BLOCK = 16


def _verify_through(
    runner,
    hf_model,
    drafts_for,
    num_steps: int,
    d: int | dict[int, int] | Callable[[int], int] = 3,
    sampling=None,
    num_seqs=2,
    ahead: bool = False,
) -> tuple[dict, int]:
    """Drives a runner by hand: two prompts (or the first `num_seqs`), then steps that each verify
    `d` proposals per request (or d[seq_id], or d(step); `drafts_for(seq_id, tokens so far)`: their
    ids, as many as it returns, or None for the draft model's d), trimming and growing the tables
    as the protocol says; with `ahead`, after each output as the service does
    (`ModelRunner.launch_ahead`). Greedy (unless
    `sampling`, a pb.Sampling): the outputs must equal Hugging Face's. Returns each request's
    outputs and how many tokens the verifications accepted."""
    from pagedserve.protos import executor_pb2 as pb

    runner.reset()
    prompts = dict(list({1: list(range(30, 47)), 2: [5, 6, 7, 5, 6]}.items())[:num_seqs])
    blocks = {1: list(range(1, 9)), 2: list(range(9, 17))}

    def drafts_at(step: int) -> dict[int, int]:
        if callable(d):
            return dict.fromkeys(prompts, d(step))
        return d if isinstance(d, dict) else dict.fromkeys(prompts, d)

    def execute(plan):
        pending = runner.launch(plan)
        out = runner.finish(pending)
        if ahead:
            runner.launch_ahead(pending)
        return out

    greedy = sampling or pb.Sampling(temperature=0)
    plan = pb.StepPlan(step_id=0)
    for seq_id, prompt in prompts.items():
        first = blocks[seq_id][: -(-len(prompt) // BLOCK)]
        plan.new_requests.add(
            seq_id=seq_id, token_ids=prompt, num_computed_tokens=0, num_new_tokens=len(prompt),
            block_tables=[pb.BlockTable(first_index=0, block_ids=first)], sampling=greedy,
        )  # fmt: skip
    out = execute(plan)
    tokens = {s: list(prompts[s]) for s in prompts}
    ends = {s: -(-len(prompts[s]) // BLOCK) for s in prompts}
    for seq_id, token in zip(out.seq_ids, out.token_ids, strict=True):
        tokens[seq_id].append(token)
    accepted = 0
    lookahead = {}  # a draft model's verification holds the next one's slots (num_lookahead_slots)
    for step in range(1, num_steps):
        plan = pb.StepPlan(step_id=step)
        drafts = drafts_at(step)
        for seq_id in prompts:
            ids = drafts_for(seq_id, tokens[seq_id])
            computed, n = len(tokens[seq_id]) - 1, drafts[seq_id] if ids is None else len(ids)
            lookahead[seq_id] = runner.num_lookahead_slots if ids is None and n else 0
            need = -(-(computed + 1 + n + lookahead[seq_id]) // BLOCK)
            running = plan.running.add(seq_id=seq_id, num_new_tokens=1 + n, num_draft_tokens=n)
            if need > ends[seq_id]:
                running.new_blocks.add(
                    first_index=ends[seq_id], block_ids=blocks[seq_id][ends[seq_id] : need]
                )
                ends[seq_id] = need
            if ids is not None:
                running.draft_token_ids.extend(ids)
        out = execute(plan)
        offset = 0
        counts = out.num_tokens or [1] * len(out.seq_ids)  # (no proposal at all: a decode step)
        for seq_id, count in zip(out.seq_ids, counts, strict=True):
            tokens[seq_id] += out.token_ids[offset : offset + count]
            offset += count
            accepted += count - 1
            # Trimmed to the last computed token, or the lookahead slots past it.
            ends[seq_id] = min(ends[seq_id], -(-(len(tokens[seq_id]) - 1 + lookahead[seq_id]) // BLOCK))
    outputs = {s: tokens[s][len(prompts[s]) :] for s in prompts}
    for seq_id, prompt in prompts.items():
        if sampling is None:
            assert outputs[seq_id] == hf_greedy(hf_model, prompt, len(outputs[seq_id])), seq_id
    return outputs, accepted


def _through_graph_layouts(
    runner, monkeypatch, proposal_graphs: bool = False, decode_sizes: tuple[int, ...] = (1, 2, 4)
) -> list | None:
    """The runner's steps computed as their CUDA graphs would compute them (padded static inputs,
    no capture: the CPU can run it); with a draft model, its passes too (returns the names of the
    draft graphs' calls: `run`, `run_next`, `propose`, `accept`), with `proposal_graphs` its greedy
    proposal graphs of 3 passes for up to 4 sequences and their acceptance graphs (one sequence:
    its 4 verification rows fit the target's 5 logits rows). (On the CPU a fill poisons what it
    does not write: a graph must read nothing else, as on CUDA that is whatever its staging buffer
    held.)"""
    from pagedserve.executor.cuda_graphs import StepGraphs

    graphs = StepGraphs(runner.model, runner._layer_caches, runner.slots, list(decode_sizes), [32, 64])
    monkeypatch.setattr(graphs, "run", graphs.run_uncaptured)
    monkeypatch.setattr(runner, "graphs", graphs)
    if runner.draft is not None:  # the draft's graphs: its passes over the step and its proposals
        draft_graphs = StepGraphs(runner.draft, runner._draft_caches, runner.slots, [1, 2, 4], [32, 64])
        if proposal_graphs:
            draft_graphs.prepare_proposals(3, 4)
            draft_graphs.prepare_acceptance(graphs.logits)
        calls = []
        for name in ("run", "run_next", "propose", "accept"):
            uncaptured = getattr(draft_graphs, f"{name}_uncaptured")
            monkeypatch.setattr(
                draft_graphs, name, lambda *a, _f=uncaptured, _n=name: calls.append(_n) or _f(*a)
            )
        monkeypatch.setattr(runner, "draft_graphs", draft_graphs)
        return calls
    return None


@pytest.fixture(scope="module")
def ngram_runner(tiny_model_dir):
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.runner import ModelRunner

    config = ExecutorConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", num_gpu_blocks_override=64,
        max_model_len=256, max_num_seqs=4, swap_space=0.002,
    )  # fmt: skip
    return ModelRunner.create(config)


@pytest.fixture(scope="module")
def draft_runner(tiny_model_dir, tmp_path_factory):
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.runner import ModelRunner
    from tests.services import perturbed_copy

    draft = perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("d") / "draft", scale=0.15)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    config = ExecutorConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", num_gpu_blocks_override=64,
        max_model_len=256, max_num_seqs=4, swap_space=0.002, speculative_config=spec,
    )  # fmt: skip
    return ModelRunner.create(config)


@pytest.mark.parametrize("graphs", [False, True])
def test_verification_steps_equal_hf_eagerly_and_in_graph_layouts(
    ngram_runner, hf_model, monkeypatch, graphs
):
    """Proposals that are the true continuation with every third one wrong: greedy outputs equal
    Hugging Face's, in eager steps and in the mixed graphs' padded layout."""
    if graphs:
        _through_graph_layouts(ngram_runner, monkeypatch)
    before = ngram_runner.stats.graph_steps

    def drafts_for(seq_id: int, tokens: list[int]) -> list[int]:
        truth = hf_greedy(hf_model, tokens, 3)
        return [t if (len(tokens) + i) % 3 else (t + 1) % 512 for i, t in enumerate(truth)]

    _, accepted = _verify_through(ngram_runner, hf_model, drafts_for, num_steps=6)
    assert accepted > 0
    assert (ngram_runner.stats.graph_steps - before > 0) == graphs


def _uneven_drafts(hf_model, num_seqs: int) -> Callable[[int, list[int]], list[int]]:
    """n-gram-like proposals, the true continuation with every fourth token wrong: 1 to 3 per
    step for one request; for two, 1 to 2 and 0 to 1 (none: the request decodes one token; the
    test runners' mixed graphs hold 5 rows)."""

    def drafts_for(seq_id: int, tokens: list[int]) -> list[int]:
        count = 1 + len(tokens) % 3 if num_seqs == 1 else (1 if seq_id == 1 else 0) + len(tokens) % 2
        truth = hf_greedy(hf_model, tokens, count) if count else []
        return [t if (len(tokens) + i) % 4 else (t + 1) % 512 for i, t in enumerate(truth)]

    return drafts_for


@pytest.mark.parametrize("repeating", [False, True], ids=["random", "one token"])
@pytest.mark.parametrize("num_drafts", [[4], [0, 3], [2, 1, 0], [1, 5, 2, 3, 0, 4, 1]])
def test_point_acceptance_equals_the_reference_on_random_logits(ngram_runner, num_drafts, repeating):
    """`StepGraphs.accept_points` (what its graph replays) on random logits and proposals, each
    the row's argmax two times in three: per sequence the argmax of its rows up to its first
    wrong proposal, that count, and its last token fed to its slot; decodes (no proposal) among
    the verifications, the sequences padded to the graph's size (3 to 4, 7 to 8). With one token
    the argmax of every row, the input of every row and every proposal, a sequence accepts all
    of its own proposals and no more (its rows end before the widest sequence's)."""
    from pagedserve.executor.cuda_graphs import StepGraphs
    from pagedserve.executor.step_inputs import RequestSlots, build_host_batch

    rng = np.random.default_rng(len(num_drafts))
    cpu, vocab = torch.device("cpu"), ngram_runner.spec.vocab_size
    slots = RequestSlots(32, ngram_runner.slots.max_blocks_per_seq, cpu)
    graphs = StepGraphs(ngram_runner.model, ngram_runner._layer_caches, slots, [1, 2, 4, 8], [64])
    q_lens = np.array(num_drafts) + 1
    offsets = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    logits = torch.from_numpy(rng.standard_normal((int(q_lens.sum()), vocab), dtype=np.float32))
    if repeating:
        logits[:, 7] += 100  # 7: each sequence's first token too
    target = logits.argmax(dim=-1).tolist()
    drafts = [
        [target[o + j] if repeating or rng.random() < 2 / 3 else int(rng.integers(vocab)) for j in range(d)]
        for o, d in zip(offsets, num_drafts, strict=True)
    ]
    num = len(num_drafts)
    batch = build_host_batch(
        np.arange(num), rng.integers(10, 40, num), q_lens, np.ones(num, dtype=bool),
        [np.array([7, *d], dtype=np.int64) for d in drafts], slots.table_host, ngram_runner.block_size,
    )  # fmt: skip
    graphs._fill(batch, 64, True)
    graphs.logits[: len(logits)] = logits
    emitted = graphs.accept_points(num, max(num_drafts))
    for i, (o, d) in enumerate(zip(offsets, num_drafts, strict=True)):
        accepted = next((j for j in range(d) if drafts[i][j] != target[o + j]), d)
        assert emitted[i, -1] == accepted + 1
        assert emitted[i, : accepted + 1].tolist() == target[o : o + accepted + 1]
        assert slots.last_token[i] == target[o + accepted]


def test_the_step_trace_names_verification_steps(ngram_runner, hf_model, monkeypatch, tmp_path):
    """--step-trace: a step of verifications (beside a decode or alone) is of kind "verify", in
    eager steps and in replayed ones, with its per-step medians in the summary."""
    from pagedserve.executor.step_trace import StepTracer, load, summarize

    for graphs in (False, True):
        if graphs:
            _through_graph_layouts(ngram_runner, monkeypatch, decode_sizes=(1, 4))
        path = tmp_path / f"trace-{graphs}.jsonl"
        monkeypatch.setattr(ngram_runner, "tracer", StepTracer(path, torch.device("cpu")))
        _verify_through(ngram_runner, hf_model, _uneven_drafts(hf_model, 2), num_steps=5)
        ngram_runner.tracer.close()
        records = load(path)
        assert records[0]["verified"] == 0 and all(r["verified"] >= 1 for r in records[1:])
        text = summarize(records)
        assert "| verify | 4 |" in text and "| prefill | 1 |" in text
    assert "launch ms p50" in text


@pytest.mark.parametrize("num_seqs", [1, 2])
def test_ngram_verifications_accept_in_graph_layouts(ngram_runner, hf_model, monkeypatch, num_seqs):
    """Greedy n-gram verifications, 1 to 3 proposals per request and step (some wrong), alone or
    beside a one-token decode: each step replays the target's mixed graph and the point
    acceptance (`accept_points`: its proposals and layout read from the graph's static inputs;
    two sequences pad to four), and the outputs equal Hugging Face's and the eager steps'."""
    drafts_for = _uneven_drafts(hf_model, num_seqs)
    want, _ = _verify_through(ngram_runner, hf_model, drafts_for, num_steps=7, num_seqs=num_seqs)
    _through_graph_layouts(ngram_runner, monkeypatch, decode_sizes=(1, 4))
    replayed = []  # per step replayed, its requests' proposal counts
    replay = ngram_runner._replay_verification

    def recorded(steps, *args) -> bool:
        done = replay(steps, *args)
        if done:
            replayed.append([s.num_draft for s in steps])
        return done

    monkeypatch.setattr(ngram_runner, "_replay_verification", recorded)
    got, accepted = _verify_through(ngram_runner, hf_model, drafts_for, num_steps=7, num_seqs=num_seqs)
    assert got == want and accepted > 0
    assert len(replayed) == 6  # every verification step
    if num_seqs == 2:
        assert any(0 in counts for counts in replayed)  # a decode beside a verification


@pytest.mark.parametrize("graphs", [None, "per pass", "proposal"])
def test_draft_model_steps_equal_hf_eagerly_and_in_graph_layouts(draft_runner, hf_model, monkeypatch, graphs):
    """The executor's draft proposes (some right, some wrong): greedy outputs equal Hugging Face's,
    its proposals reach the target's input rows in eager steps and in the graphs' layout: pass 0
    staged from the host, the later passes derived on the device (a decode graph per pass, or the
    three passes in one proposal graph)."""
    calls = None
    if graphs is not None:
        calls = _through_graph_layouts(draft_runner, monkeypatch, proposal_graphs=graphs == "proposal")
    before = draft_runner.stats.graph_steps
    _, accepted = _verify_through(draft_runner, hf_model, lambda seq_id, tokens: None, num_steps=6)
    assert accepted > 0
    assert (draft_runner.stats.graph_steps - before > 0) == (graphs is not None)
    # The prompts' step runs the draft over its tokens; a verification step runs its proposal
    # passes alone (the last of them writes the last proposal's KV): no pass over the step.
    if graphs == "per pass":  # per verification pass 0, 2 more proposals, the last one's KV
        assert sorted(calls) == sorted(["run"] * (1 + 5) + ["run_next"] * 5 * 3)
    if graphs == "proposal":  # per verification one proposal graph
        assert sorted(calls) == sorted(["run"] + ["propose"] * 5)
    assert draft_runner.kv_cache.layout.layers_per_block == 4  # the target's 2 layers, the draft's 2


@pytest.mark.parametrize("graphs", [None, "per pass", "proposal"])
def test_one_requests_verifications_replay_whole_in_graph_layouts(
    draft_runner, hf_model, monkeypatch, graphs
):
    """One greedy request (a step of verifications alone, 3 proposals each): with proposal graphs
    each step replays its proposal graph, the target's mixed graph and the acceptance graph, and
    launches nothing else on the device; greedy outputs equal Hugging Face's and the eager steps'
    (so do the per-pass graphs', which take the general path)."""
    calls = None
    if graphs is not None:
        calls = _through_graph_layouts(draft_runner, monkeypatch, proposal_graphs=graphs == "proposal")
    got, accepted = _verify_through(draft_runner, hf_model, lambda *_: None, num_steps=8, num_seqs=1)
    assert accepted > 0 and len(got[1]) == 1 + 7 + accepted  # the prompt step, then 7 verifications
    if graphs == "proposal":
        assert sorted(calls) == sorted(["run"] + ["propose", "accept"] * 7)
    if graphs == "per pass":
        assert "accept" not in calls


def test_verifications_launched_ahead_of_their_plans_equal_hf(draft_runner, hf_model, monkeypatch, tmp_path):
    """After each verification's output the runner launches the step the next plan most likely
    is (`launch_ahead`; one request: the test's graphs accept one at a time): a plan that is that
    step takes it, one that differs (here: two proposals instead of three at steps 4 and 7)
    discards it and runs itself. Its blocks are there: each verification's plan reserves the next
    one's slots. Greedy outputs equal Hugging Face's throughout; the executor's metrics count
    both; a step trace tells the steps launched ahead from the others, with when their plans
    came."""
    from pagedserve.executor.metrics import executor_registry
    from pagedserve.executor.step_trace import StepTracer, load, summarize

    _through_graph_layouts(draft_runner, monkeypatch, proposal_graphs=True)
    monkeypatch.setattr(draft_runner, "tracer", StepTracer(tmp_path / "trace.jsonl", torch.device("cpu")))
    stats = draft_runner.stats
    taken, discarded = stats.steps_launched_ahead, stats.steps_discarded_ahead
    got, accepted = _verify_through(
        draft_runner, hf_model, lambda *_: None, num_steps=12, num_seqs=1, ahead=True,
        d=lambda step: 2 if step in (4, 7) else 3,
    )  # fmt: skip
    assert accepted > 0
    # Plans 2-11 each find a step launched ahead, but for plans 5 and 8 (steps 4 and 7 were not
    # replayed whole: fewer proposals than k); plans 4 and 7 discard theirs; the other six take it,
    # new blocks or not (the lookahead slots were there at the launch).
    assert stats.steps_launched_ahead - taken == 6
    assert stats.steps_discarded_ahead - discarded == 2
    registry = executor_registry(draft_runner, "m")  # the executor's Prometheus counters
    for name in ("launched", "discarded"):
        metric = f"pagedserve:executor_steps_{name}_ahead_total"
        assert registry.get_sample_value(metric, {"model_name": "m"}) == getattr(stats, f"steps_{name}_ahead")
    draft_runner.tracer.close()
    records = load(tmp_path / "trace.jsonl")
    ahead = [r for r in records if r["ahead"]]
    assert len(ahead) == 6 and all(r["launched_at_ms"] < r["plan_at_ms"] < r["output_at_ms"] for r in ahead)
    assert "| launched ahead | 6 |" in summarize(records)


def _tokens_proposals(hf_model, k: int) -> Callable[..., list[int]]:
    """A stand-in for `propose_ngram` (same arguments) that proposes whether or not the tokens
    repeat an n-gram, as the tiny model's outputs seldom do: the true continuation, every fourth
    token wrong, k tokens for the first request (its prompt starts at 30) and none or one by
    turns for the second."""

    def propose(tokens, count: int, lookup_min: int, lookup_max: int) -> list[int]:
        tokens = [int(t) for t in tokens]
        if tokens[0] != 30:
            count = min(count, len(tokens) % 2)
        true = hf_greedy(hf_model, tokens, count) if count else []
        return [t if (len(tokens) + i) % 4 else (t + 1) % 512 for i, t in enumerate(true)]

    return propose


def _ngram_plans_ahead(runner, hf_model, monkeypatch, num_seqs: int, k: int) -> tuple[dict, list[list[int]]]:
    """Drives `runner` through 12 steps of n-gram verifications launched ahead (`ModelRunner.ngram`
    set): plans that propose as the runner does (`_tokens_proposals`), but for steps 4 and 7,
    which propose one token fewer. Returns the outputs (equal to Hugging Face's) and the tokens
    the runner proposed from."""
    propose, seen = _tokens_proposals(hf_model, k), []
    recorded = lambda tokens, *a: seen.append(list(tokens)) or propose(tokens, *a)  # noqa: E731
    monkeypatch.setattr("pagedserve.executor.runner.propose_ngram", recorded)
    ngram = SpeculativeConfig("ngram", k, prompt_lookup_max=3, prompt_lookup_min=1)
    monkeypatch.setattr(runner, "ngram", ngram)
    step = dict.fromkeys((1, 2), 0)

    def drafts_for(seq_id: int, tokens: list[int]) -> list[int]:
        step[seq_id] += 1
        drafts = propose(tokens, k, 1, 3)
        return drafts[:-1] if step[seq_id] in (4, 7) else drafts

    got, accepted = _verify_through(runner, hf_model, drafts_for, num_steps=12, num_seqs=num_seqs, ahead=True)
    assert accepted > 0
    return got, seen


@pytest.mark.parametrize(("num_seqs", "k"), [(1, 3), (2, 1)])
def test_ngram_verifications_launched_ahead_of_their_plans_equal_hf(
    ngram_runner, hf_model, monkeypatch, num_seqs, k
):
    """With n-gram speculation configured (`ModelRunner.ngram`, the executor's own flag), after a
    replayed verification's output the runner proposes from each request's tokens as the
    scheduler knows them (its prompt and every output since) and launches that step; a request
    without a proposal decodes beside the others. A plan that proposes the same takes it; steps 4
    and 7 propose one token fewer, and discard theirs. Greedy outputs equal Hugging Face's
    throughout; without n-gram configured nothing is launched ahead."""
    _through_graph_layouts(ngram_runner, monkeypatch, decode_sizes=(1, 4))
    stats = ngram_runner.stats
    before = stats.steps_launched_ahead, stats.steps_discarded_ahead
    propose = _tokens_proposals(hf_model, k)
    plain = lambda _, tokens: propose(tokens, k, 1, 3)  # noqa: E731
    _verify_through(ngram_runner, hf_model, plain, 12, num_seqs=num_seqs, ahead=True)
    assert (stats.steps_launched_ahead, stats.steps_discarded_ahead) == before  # not configured
    _, seen = _ngram_plans_ahead(ngram_runner, hf_model, monkeypatch, num_seqs, k)
    taken, discarded = stats.steps_launched_ahead - before[0], stats.steps_discarded_ahead - before[1]
    assert taken >= 4 and discarded == 2  # (a proposal past the blocks held launches nothing)
    # Every history the runner proposed from is the request's prompt and greedy outputs so far.
    prompt = list(range(30, 47))
    truth = prompt + hf_greedy(hf_model, prompt, 60)
    assert seen and all(tokens == truth[: len(tokens)] for tokens in seen if tokens[0] == 30)


def test_a_bad_plan_for_a_step_launched_ahead_is_refused_and_rolled_back(draft_runner, hf_model, monkeypatch):
    """A plan that is the step launched ahead but for blocks appended where the table does not end
    is refused as any bad plan is (PlanError, nothing applied): the step launched ahead is rolled
    back, and the plan made right then runs, with Hugging Face's greedy tokens throughout."""
    from pagedserve.executor.plan_check import PlanError
    from pagedserve.executor.runner import PendingStep
    from pagedserve.protos import executor_pb2 as pb

    _through_graph_layouts(draft_runner, monkeypatch, proposal_graphs=True)
    runner, stats = draft_runner, draft_runner.stats
    runner.reset()
    k, lookahead = runner.num_speculative_tokens, runner.num_lookahead_slots
    prompt = list(range(30, 47))
    plan = pb.StepPlan(step_id=0)
    plan.new_requests.add(
        seq_id=1, token_ids=prompt, num_computed_tokens=0, num_new_tokens=len(prompt),
        block_tables=[pb.BlockTable(first_index=0, block_ids=[1, 2])], sampling=pb.Sampling(temperature=0),
    )  # fmt: skip
    tokens = prompt + list(runner.execute(plan).token_ids)
    ends = 2  # the table's length, as the executor holds it

    def verification(step_id: int, bad: bool = False) -> pb.StepPlan:
        """The next verification's plan: k proposals, blocks up to the next one's slots; `bad`:
        one block more, appended one entry past the table's end."""
        need = -(-(len(tokens) + k + lookahead) // BLOCK)
        plan = pb.StepPlan(step_id=step_id)
        running = plan.running.add(seq_id=1, num_new_tokens=k + 1, num_draft_tokens=k)
        if bad:
            running.new_blocks.add(first_index=ends + 1, block_ids=[9])
        elif need > ends:
            running.new_blocks.add(first_index=ends, block_ids=list(range(ends + 1, need + 1)))
        return plan

    def run(plan: pb.StepPlan) -> PendingStep:
        nonlocal ends, tokens
        pending = runner.launch(plan)
        for table in plan.running[0].new_blocks:
            ends += len(table.block_ids)
        tokens += runner.finish(pending).token_ids
        ends = min(ends, -(-(len(tokens) - 1 + lookahead) // BLOCK))  # trimmed as the protocol says
        return pending

    runner.launch_ahead(run(verification(1)))
    discarded = stats.steps_discarded_ahead
    with pytest.raises(PlanError, match="new blocks start at entry"):
        runner.launch(verification(2, bad=True))
    assert stats.steps_discarded_ahead == discarded + 1
    run(verification(2))
    assert tokens[len(prompt) :] == hf_greedy(hf_model, prompt, len(tokens) - len(prompt))


@pytest.mark.parametrize("graphs", [None, "per pass", "proposal"])
def test_draft_proposals_of_uneven_counts_equal_hf(draft_runner, hf_model, monkeypatch, graphs):
    """Requests with 3 and 1 proposals in one step: the one with fewer sits out the later passes
    (no KV written past its slots, its extra proposals ignored); greedy outputs equal HF's."""
    if graphs is not None:
        _through_graph_layouts(draft_runner, monkeypatch, proposal_graphs=graphs == "proposal")
    _, accepted = _verify_through(draft_runner, hf_model, lambda *_: None, num_steps=6, d={1: 3, 2: 1})
    assert accepted > 0


@pytest.fixture(scope="module")
def exact_draft_runner(tiny_model_dir):
    """A runner whose draft is the target itself: every greedy proposal is accepted."""
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.runner import ModelRunner

    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}
    config = ExecutorConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", num_gpu_blocks_override=64,
        max_model_len=256, max_num_seqs=4, swap_space=0.002, speculative_config=spec,
    )  # fmt: skip
    return ModelRunner.create(config)


@pytest.mark.parametrize("graphs", [None, "per pass", "proposal"])
@pytest.mark.parametrize("exact", [False, True], ids=["perturbed draft", "exact draft"])
def test_the_draft_holds_the_kv_of_every_computed_token(
    draft_runner, exact_draft_runner, hf_model, monkeypatch, graphs, exact
):
    """A verification step runs the draft over no token of its own (its proposal passes wrote that
    KV, the last pass the last proposal's), only over the other requests' (a prompt arriving in the
    same step): after verifications beside a prefill, the draft's KV of every computed token equals
    one eager prefill of the draft over the same tokens, and greedy outputs equal HF's. The exact
    draft has every proposal accepted (the last pass's KV is kept), the perturbed one some."""
    from pagedserve.executor.step_inputs import build_step_inputs
    from pagedserve.protos import executor_pb2 as pb

    runner, drafts = exact_draft_runner if exact else draft_runner, {1: 3, 2: 1}
    if graphs is not None:
        _through_graph_layouts(runner, monkeypatch, proposal_graphs=graphs == "proposal")
    runner.reset()
    prompts = {1: list(range(30, 47)), 2: [5, 6, 7, 5, 6, 9, 11]}
    blocks = {1: list(range(1, 9)), 2: list(range(9, 17))}
    tokens: dict[int, list[int]] = {}
    ends: dict[int, int] = {}
    greedy = pb.Sampling(temperature=0)
    all_accepted = 0  # verifications that accepted every proposal: the last pass's KV is kept
    for step in range(6):
        plan = pb.StepPlan(step_id=step)
        for seq_id in tokens:  # verifications
            computed, d = len(tokens[seq_id]) - 1, drafts[seq_id]
            running = plan.running.add(seq_id=seq_id, num_new_tokens=1 + d, num_draft_tokens=d)
            need = -(-(computed + 1 + d) // BLOCK)
            if need > ends[seq_id]:
                running.new_blocks.add(
                    first_index=ends[seq_id], block_ids=blocks[seq_id][ends[seq_id] : need]
                )
        if step < 2:  # request 1's prompt, then request 2's beside request 1's first verification
            seq_id, prompt = step + 1, prompts[step + 1]
            first = blocks[seq_id][: -(-len(prompt) // BLOCK)]
            plan.new_requests.add(
                seq_id=seq_id, token_ids=prompt, num_computed_tokens=0, num_new_tokens=len(prompt),
                block_tables=[pb.BlockTable(first_index=0, block_ids=first)], sampling=greedy,
            )  # fmt: skip
            tokens[seq_id] = list(prompt)
        out = runner.execute(plan)
        offset = 0
        counts = out.num_tokens or [1] * len(out.seq_ids)  # (a step without verifications)
        for seq_id, count in zip(out.seq_ids, counts, strict=True):
            tokens[seq_id] += out.token_ids[offset : offset + count]
            offset += count
            ends[seq_id] = -(-(len(tokens[seq_id]) - 1) // BLOCK)
            all_accepted += bool(out.num_tokens) and count == drafts[seq_id] + 1
    verifications = 5 + 4  # request 1 in steps 1-5, request 2 in steps 2-5
    assert all_accepted == verifications if exact else all_accepted < verifications
    for seq_id, prompt in prompts.items():
        got = tokens[seq_id][len(prompt) :]
        assert got == hf_greedy(hf_model, prompt, len(got)), seq_id
        computed = len(tokens[seq_id]) - 1
        table = blocks[seq_id][: -(-computed // BLOCK)]
        inputs = build_step_inputs([tokens[seq_id][:computed]], [0], [table], [True], BLOCK, runner.device)
        fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner._draft_caches]
        runner.draft(inputs.input_ids, inputs.meta, fresh, inputs.logits_indices)
        for (k, v), (k_ref, v_ref) in zip(runner._draft_caches, fresh, strict=True):
            for cache, ref in ((k, k_ref), (v, v_ref)):
                held = cache[table].flatten(0, 1)[:computed]
                torch.testing.assert_close(held, ref[table].flatten(0, 1)[:computed], atol=1e-4, rtol=1e-4)


def test_seeded_draft_sampling_is_the_same_eagerly_and_through_the_graphs(draft_runner, monkeypatch):
    """Sampled proposals (top-k, seeded): the per-(seed, position) noise drawn for all passes at
    once gives the same tokens in eager passes and through the decode graphs' device-side inputs."""
    from pagedserve.protos import executor_pb2 as pb

    sampling = pb.Sampling(temperature=0.8, top_k=40, has_seed=True, seed=11)
    eager, _ = _verify_through(draft_runner, None, lambda *_: None, num_steps=5, sampling=sampling)
    with monkeypatch.context() as m:
        calls = _through_graph_layouts(draft_runner, m)
        graphed, _ = _verify_through(draft_runner, None, lambda *_: None, num_steps=5, sampling=sampling)
    assert "run_next" in calls and "propose" not in calls
    assert graphed == eager


def test_next_pass_inputs_equal_the_host_batch_of_that_pass():
    """The device-derived inputs of proposal pass j are what `build_host_batch` builds for it; a
    request past its last proposal (limit) and a padding row (limit -1) write no KV."""
    from pagedserve.executor.step_inputs import RequestSlots, build_host_batch, next_pass_inputs

    slots = RequestSlots(4, 8, torch.device("cpu"))
    slots.set_blocks(0, 0, [5, 9, 2])
    slots.set_blocks(2, 0, [7, 3, 11, 4])
    slots.flush()
    rows, base = np.array([0, 2, 4]), np.array([14, 30, 0])
    limits = np.array([14 + 2, 30 + 0, -1])  # 3 and 1 proposals, a padding row
    for j in range(1, 3):
        got = next_pass_inputs(
            torch.tensor(rows), torch.tensor(base), torch.tensor(limits), j, slots.table, BLOCK
        )
        active = base + j <= limits
        want = build_host_batch(
            rows=rows[active], starts=base[active] + j, q_lens=np.ones(active.sum(), dtype=np.int64),
            samples=np.ones(active.sum(), dtype=bool), host_chunks=[np.zeros(1)] * active.sum(),
            table=slots.table_host, block_size=BLOCK,
        )  # fmt: skip
        assert got.positions[active].tolist() == want.positions.tolist()
        assert got.seq_lens[active].tolist() == want.seq_lens.tolist()
        assert got.slot_mapping[0, active].tolist() == want.slot_mapping[0].tolist()
        assert got.slot_mapping[0, ~active].tolist() == [-1] * (~active).sum()
        assert got.positions[~active].tolist() == base[~active].tolist()


def test_decode_batch_of_verification_rows_equals_the_host_batch_of_pass_0():
    """The draft's first proposal pass, taken from the step's batch (each verification's first
    row: its last token, fed from the device or known on the host), is what `build_host_batch`
    builds for it."""
    from dataclasses import fields

    from pagedserve.executor.step_inputs import RequestSlots, build_host_batch, decode_batch

    slots = RequestSlots(4, 8, torch.device("cpu"))
    slots.set_blocks(0, 0, [5, 9, 2])
    slots.set_blocks(2, 0, [7, 3, 11, 4])
    slots.flush()
    rows, starts = np.array([2, 0]), np.array([30, 14])
    # Request at slot 2 verifies 3 proposals from a fed token; the one at slot 0, 2 from a known one.
    step = build_host_batch(
        rows=rows, starts=starts, q_lens=np.array([4, 3]), samples=np.array([False, False]),
        host_chunks=[np.array([0, 0, 0]), np.array([77, 0, 0])], table=slots.table_host,
        block_size=BLOCK, fed_offsets=np.array([0, -1]),
    )  # fmt: skip
    got = decode_batch(step, np.array([0, 4]), rows, BLOCK)
    want = build_host_batch(
        rows=rows, starts=starts, q_lens=np.ones(2, dtype=np.int64), samples=np.ones(2, dtype=bool),
        host_chunks=[np.zeros(0, dtype=np.int64), np.array([77])], table=slots.table_host, block_size=BLOCK,
    )  # fmt: skip
    for f in fields(want):
        assert np.array_equal(getattr(got, f.name), getattr(want, f.name)), f.name


def test_a_draft_of_another_kv_shape_is_refused(ngram_runner, tmp_path):
    """The draft's KV shares the target's blocks: another head_dim is refused at start, named."""
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.loader import UnsupportedModelError
    from pagedserve.executor.runner import load_draft_model
    from pagedserve.tiny_model import TinyModelSpec, write_tiny_model

    other = write_tiny_model(tmp_path / "other", TinyModelSpec(hidden_size=64, num_attention_heads=2))
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    config = ExecutorConfig(model=str(other), device="cpu", speculative_config=spec)
    with pytest.raises(UnsupportedModelError, match="has head_dim 32, the target 16"):
        load_draft_model(config, ngram_runner.model)


def test_llm_takes_a_speculative_config(tiny_model_dir, hf_model):
    """The offline API: LLM(speculative_config={...}) speculates (greedy equals HF) and refuses a
    bad config naming the field."""
    from pagedserve import LLM
    from pagedserve import SamplingParams as LLMSamplingParams

    with pytest.raises(ValueError, match="speculative_config.prompt_lookup_max: the ngram method needs it"):
        LLM(
            str(tiny_model_dir),
            device="cpu",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(
        str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        num_gpu_blocks_override=64,
        speculative_config=spec,
    )
    try:
        prompt = [7, 8, 9, 10, 11, 7, 8, 9]
        (out,) = llm.generate(
            {"prompt_token_ids": prompt}, LLMSamplingParams(temperature=0, max_tokens=24), use_tqdm=False
        )
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)
    finally:
        llm.shutdown()


def test_plan_counts_a_draft_models_weights_and_kv_layers(capsys):
    """`pagedserve plan --speculative-config` (the built-in model and its draft): each block holds
    the draft's 2 layers beside the target's, and the weights are both models'."""
    from pagedserve import plan
    from pagedserve.common.default_model import DEFAULT_DRAFT_MODEL_DIR

    def planned(*flags: str) -> dict:
        assert plan.main(["--device", "cpu", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    alone = planned()
    spec = {"method": "draft_model", "model": str(DEFAULT_DRAFT_MODEL_DIR), "num_speculative_tokens": 4}
    with_draft = planned("--speculative-config", json.dumps(spec))
    layers = sum(g["num_layers"] for g in alone["kv_groups"])
    assert with_draft["kv_bytes_per_block"] * layers == alone["kv_bytes_per_block"] * (layers + 2)
    assert with_draft["weight_bytes"] > alone["weight_bytes"]


# ---- on CUDA: the captured proposal graphs against eager passes -----------------------------------


def _cuda_draft_runner(model_dir, draft_dir, eager: bool):
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.runner import ModelRunner

    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    config = ExecutorConfig(
        model=str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=64,
        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, swap_space=0.002,
        speculative_config=spec, enforce_eager=eager,
    )  # fmt: skip
    return ModelRunner.create(config)


@pytest.fixture(scope="module")
def cuda_draft_runners(tiny_model_dir, tmp_path_factory):
    """(eager, graphs) draft-model runners on CUDA; the graphs one captured its proposal graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.services import perturbed_copy

    draft = perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("d") / "draft", scale=0.15)
    return _cuda_draft_runner(tiny_model_dir, draft, True), _cuda_draft_runner(tiny_model_dir, draft, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d", [3, {1: 3, 2: 1}], ids=["three each", "uneven"])
def test_cuda_proposal_graphs_equal_eager_and_hf(cuda_draft_runners, hf_model, monkeypatch, d):
    """Greedy: the captured proposal graph (one replay per verification step) gives the outputs of
    eager passes, which equal Hugging Face's; seeded sampling (decode graph replays per pass from
    device-side inputs) gives the eager passes' tokens."""
    from pagedserve.protos import executor_pb2 as pb

    eager, graphs = cuda_draft_runners
    assert graphs.draft_graphs is not None and graphs.draft_graphs.can_propose(2, 3)
    calls = []
    for name in ("propose", "run_next"):
        real = getattr(graphs.draft_graphs, name)
        counted = lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a)  # noqa: E731
        monkeypatch.setattr(graphs.draft_graphs, name, counted)
    none = lambda *_: None  # noqa: E731
    want, _ = _verify_through(eager, hf_model, none, num_steps=8, d=d)
    got, accepted = _verify_through(graphs, hf_model, none, num_steps=8, d=d)
    assert got == want and accepted > 0
    assert calls == ["propose"] * 7
    sampling = pb.Sampling(temperature=0.8, top_k=40, has_seed=True, seed=11)
    want, _ = _verify_through(eager, None, none, num_steps=6, d=d, sampling=sampling)
    got, _ = _verify_through(graphs, None, none, num_steps=6, d=d, sampling=sampling)
    assert got == want
    assert calls.count("run_next") == 5 * 3  # 2 more proposals, then the last one's KV


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_acceptance_graph_equals_eager_and_hf(cuda_draft_runners, hf_model, monkeypatch):
    """One greedy request: each verification step replays the proposal graph, the target's graph
    and the captured acceptance graph (which feeds the next step); the outputs equal the eager
    runner's, which equal Hugging Face's."""
    eager, graphs = cuda_draft_runners
    assert graphs.draft_graphs is not None and graphs.draft_graphs.can_accept(1, 3)
    calls = []
    for name in ("propose", "accept"):
        real = getattr(graphs.draft_graphs, name)
        counted = lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a)  # noqa: E731
        monkeypatch.setattr(graphs.draft_graphs, name, counted)
    none = lambda *_: None  # noqa: E731
    want, _ = _verify_through(eager, hf_model, none, num_steps=8, num_seqs=1)
    got, accepted = _verify_through(graphs, hf_model, none, num_steps=8, num_seqs=1)
    assert got == want and accepted > 0
    assert calls == ["propose", "accept"] * 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_seqs", [1, 2])
def test_cuda_ngram_acceptance_graphs_equal_eager_and_hf(tiny_model_dir, hf_model, monkeypatch, num_seqs):
    """Greedy n-gram verifications (1 to 3 proposals, some wrong): the point acceptance graphs,
    captured the first time each (size, k) comes, give the eager runner's outputs, which equal
    Hugging Face's; run again, every such step replays them and its launch makes no
    synchronising call (torch raises on any)."""
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.runner import ModelRunner

    def runner(eager: bool) -> ModelRunner:
        config = ExecutorConfig(
            model=str(tiny_model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=64,
            max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, swap_space=0.002,
            enforce_eager=eager,
        )  # fmt: skip
        return ModelRunner.create(config)

    eager, graphs = runner(True), runner(False)
    drafts_for = _uneven_drafts(hf_model, num_seqs)
    want, _ = _verify_through(eager, hf_model, drafts_for, num_steps=8, num_seqs=num_seqs)
    got, accepted = _verify_through(graphs, hf_model, drafts_for, num_steps=8, num_seqs=num_seqs)
    assert got == want and accepted > 0
    calls = []
    accept, launch = graphs.graphs.accept_points, graphs.launch
    monkeypatch.setattr(graphs.graphs, "accept_points", lambda *a: calls.append(a) or accept(*a))

    def never_waits(plan):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(graphs, "launch", lambda plan: never_waits(plan) if plan.step_id else launch(plan))
    again, _ = _verify_through(graphs, hf_model, drafts_for, num_steps=8, num_seqs=num_seqs)
    assert again == want and len(calls) == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_draft_verification_launch_never_waits_for_the_device(cuda_draft_runners, temperature):
    """Launching a draft-model verification step (proposal passes, target forward, acceptance)
    makes no synchronising call: torch raises on any."""
    from pagedserve.protos import executor_pb2 as pb

    _, runner = cuda_draft_runners
    runner.reset()
    sampling = pb.Sampling(temperature=temperature, has_seed=True, seed=3)
    plan = pb.StepPlan(step_id=0)
    plan.new_requests.add(
        seq_id=1, token_ids=list(range(30, 47)), num_computed_tokens=0, num_new_tokens=17,
        block_tables=[pb.BlockTable(first_index=0, block_ids=[1, 2])], sampling=sampling,
    )  # fmt: skip
    runner.execute(plan)
    plan = pb.StepPlan(step_id=1)
    plan.running.add(seq_id=1, num_new_tokens=4, num_draft_tokens=3)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = runner.launch(plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = runner.finish(pending)
    assert 1 <= out.num_tokens[0] <= 4


def _launch_ahead_never_waits(runner, monkeypatch) -> None:
    """Has `runner.launch_ahead` raise on any synchronising call (torch's sync debug mode)."""
    launch_ahead = runner.launch_ahead

    def never_waits(pending) -> None:
        torch.cuda.set_sync_debug_mode("error")
        try:
            launch_ahead(pending)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(runner, "launch_ahead", never_waits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("num_seqs", "k"), [(1, 3), (2, 1)])
def test_cuda_ngram_verifications_launched_ahead_equal_hf(tiny_model_dir, hf_model, monkeypatch, num_seqs, k):
    """With the captured graphs: n-gram verifications launched ahead of their plans (taken, or
    discarded where a plan proposes fewer) give Hugging Face's greedy outputs, and launching one
    makes no synchronising call (torch raises on any)."""
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.executor.runner import ModelRunner

    config = ExecutorConfig(
        model=str(tiny_model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=64,
        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, swap_space=0.002,
    )  # fmt: skip
    runner = ModelRunner.create(config)
    _ngram_plans_ahead(runner, hf_model, monkeypatch, num_seqs, k)  # (captures each graph on first use)
    taken, discarded = runner.stats.steps_launched_ahead, runner.stats.steps_discarded_ahead
    _launch_ahead_never_waits(runner, monkeypatch)
    _ngram_plans_ahead(runner, hf_model, monkeypatch, num_seqs, k)
    assert runner.stats.steps_launched_ahead - taken >= 4
    assert runner.stats.steps_discarded_ahead - discarded == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_verifications_launched_ahead_equal_hf(cuda_draft_runners, hf_model, monkeypatch):
    """With the captured graphs: verifications launched ahead of their plans (taken, or discarded
    where the plan has two proposals instead of three) give Hugging Face's greedy outputs, and
    launching one makes no synchronising call (torch raises on any)."""
    _, graphs = cuda_draft_runners
    _launch_ahead_never_waits(graphs, monkeypatch)
    stats = graphs.stats
    taken, discarded = stats.steps_launched_ahead, stats.steps_discarded_ahead
    none = lambda *_: None  # noqa: E731
    fewer_at = lambda step: 2 if step in (4, 7) else 3  # noqa: E731
    _, accepted = _verify_through(graphs, hf_model, none, num_steps=12, num_seqs=1, ahead=True, d=fewer_at)
    assert accepted > 0
    assert stats.steps_launched_ahead > taken and stats.steps_discarded_ahead > discarded
