"""Structured outputs without services: the constraint's validation and wire form, the schema
features refused, xgrammar matchers and the compile pool on the tiny tokenizer, the scheduling rule
for constrained requests (no mask from a token still in flight), the executor's masking and plan
checks, and the tool-call parser. End to end: tests/test_structured_outputs_e2e.py."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import pytest
import torch

from pagedserve.common.structured_outputs import StructuredOutputs, check_json_schema
from pagedserve.common.validation import InvalidRequest, to_proto, validate_request, values_from_proto
from pagedserve.entrypoints.openai.tool_calls import (
    ToolCallParser,
    ToolChoiceError,
    merge_calls,
    plan_tools,
)
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.plan_check import PlanError, PlanLimits, validate_masks, validate_plan
from pagedserve.executor.runner import ModelRunner
from pagedserve.executor.sampler import SamplingParams, TokenMasks, apply_token_masks, sample
from pagedserve.protos import executor_pb2, generation_pb2
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.core import Scheduler
from pagedserve.scheduler.request import Request, SamplingOptions, SeqId
from pagedserve.scheduler.structured import GrammarCompilerPool, constraint_ebnf


def refused(constraint) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        validate_request({"prompt": "x", "structured_outputs": constraint})
    assert info.value.field == "structured_outputs"
    return info.value


# ---- the field ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "constraint",
    [
        {"json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}},
        {"json": '{"type": "array", "items": {"enum": [1, "x", null]}}', "disable_any_whitespace": True},
        {"json_object": True},
        {"regex": "[a-z]+"},
        {"choice": ["yes", "no", 'a "quoted"\nline']},
        {"grammar": 'root ::= "a" | "b"'},
    ],
)
def test_each_kind_crosses_the_wire_unchanged(constraint):
    params = validate_request({"prompt": "x", "structured_outputs": constraint})
    wire = generation_pb2.GenerateRequest.FromString(to_proto(params).SerializeToString())
    assert validate_request(values_from_proto(wire)) == params
    assert isinstance(params.structured_outputs, StructuredOutputs)


def test_schema_key_order_is_kept_and_json_text_is_compact():
    params = validate_request(
        {"prompt": "x", "structured_outputs": {"json": {"title": "t", "type": "object", "description": "d"}}}
    )
    assert params.structured_outputs.value == '{"title":"t","type":"object","description":"d"}'


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "grammar": "b"}, "got regex and grammar"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "must not be empty"),
        ({"json_object": "yes"}, "must be true"),
        ({"json": "{"}, "not valid JSON"),
        ({"json": 5}, "JSON schema"),
        ({"regex": "a", "disable_any_whitespace": 1}, "true or false"),
        ({"regex": "a", "whitespace_pattern": " "}, "'whitespace_pattern' is not supported"),
        ("regex", "must be an object"),
    ],
)
def test_bad_constraints_are_refused_naming_why(constraint, words):
    assert words in str(refused(constraint))


def test_min_tokens_with_a_constraint_is_refused():
    with pytest.raises(InvalidRequest) as info:
        validate_request({"prompt": "x", "min_tokens": 3, "structured_outputs": {"regex": "a+"}})
    assert info.value.field == "structured_outputs" and "min_tokens" in str(info.value)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "array", "uniqueItems": True}, "#/uniqueItems: uniqueItems"),
        ({"type": "array", "contains": {"const": 1}}, "'contains' is not supported"),
        ({"not": {"type": "null"}}, "'not' is not supported"),
        ({"type": "integer", "if": {"minimum": 1}, "then": {}}, "'if' is not supported"),
        ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "allOf of more than one"),
        ({"type": "number", "multipleOf": 0.5}, "integers only"),
        ({"type": "string", "format": "idn-email"}, "format 'idn-email'"),
        ({"type": "string", "format": "date", "maxLength": 3}, "minLength or maxLength"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "branches 0 and 1 may both match"),
        ({"type": "array", "items": [{"type": "integer"}]}, "use prefixItems"),
        ({"properties": {"a": {"$ref": "https://example.com/s"}}}, "within the schema"),
        ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "points at nothing"),
        ({"type": "strings"}, "is not a JSON type"),
        ({"properties": {"deep": {"items": {"dependentRequired": {}}}}}, "#/properties/deep/items"),
    ],
)
def test_schema_features_xgrammar_would_ignore_are_refused(schema, words):
    assert words in str(refused({"json": schema}))


def test_schema_features_that_are_enforced_pass():
    def branch(k):
        return {"type": "object", "properties": {"k": {"const": k}}, "required": ["k"]}

    check_json_schema(
        {
            "$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 9, "multipleOf": 3}},
            "type": "object",
            "title": "t",
            "x-note": "ignored",
            "properties": {
                "n": {"$ref": "#/$defs/n"},
                "kind": {"oneOf": [branch("a"), branch("b")]},
                "d": {"type": "string", "format": "date"},
                "s": {"type": ["string", "null"], "pattern": "^a+$", "maxLength": 5},
                "t": {"type": "array", "prefixItems": [{"type": "boolean"}], "items": False,
                      "uniqueItems": False},
            },
            "patternProperties": {"^x": {"type": "null"}},
            "additionalProperties": False,
            "minProperties": 1,
        }
    )  # fmt: skip


# ---- grammars on the tiny tokenizer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pool = GrammarCompilerPool(tokenizer, 512, [tokenizer.eos_token_id])
    yield tokenizer, pool
    pool.close()


def _sample_outputs(tokenizer, pool, spec, n=20, seed=0):
    """Outputs drawn uniformly among the tokens each mask allows: what only the grammar makes valid."""
    rng = np.random.default_rng(seed)
    outs = []
    for _ in range(n):
        grammar = pool.grammar_blocking(spec)
        ids = []
        while not grammar.is_terminated and len(ids) < 300:
            mask = np.empty((1, 16), dtype=np.int32)
            grammar.fill_bitmask(mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
            token = int(rng.choice(allowed))
            assert grammar.accept(token)
            ids.append(token)
        assert grammar.is_terminated, tokenizer.decode(ids)
        outs.append(tokenizer.decode(ids[:-1]))  # the last is EOS
    return outs


def test_bounded_strings_hold_no_control_characters(compiler):
    """xgrammar 0.2.9 lets a string with maxLength hold raw control characters, and any string
    UTF-16 surrogates; the EBNF is corrected, so every output is strict JSON in UTF-8."""
    tokenizer, pool = compiler
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    spec = validate_request({"prompt": "x", "structured_outputs": {"json": schema}}).structured_outputs
    assert "\\0-\\x1f" in constraint_ebnf(spec).split("root_prop_0_characters ::=")[1].splitlines()[0]
    for text in _sample_outputs(tokenizer, pool, spec, n=60):
        assert "\ufffd" not in text, text  # no surrogate's bytes either (not UTF-8)
        jsonschema.validate(json.loads(text), schema)


def test_masks_past_the_tokenizer_are_zero_and_the_same_as_over_the_logits_width(compiler):
    """A model whose logits are wider than its tokenizer (the llama-8b shape's dummy tokenizer:
    512 tokens under 128,256): the matchers know only the tokenizer's tokens (xgrammar would take
    each padding id for a special token and scan them all per token), and the masks, padded with
    zero columns, are those of a matcher over the whole width, step after step."""
    import xgrammar as xgr

    from pagedserve.bench.workloads import W1_JSON_SCHEMA
    from pagedserve.scheduler.structured import fill_bitmasks

    tokenizer, _ = compiler
    eos = tokenizer.eos_token_id
    pool = GrammarCompilerPool(tokenizer, 1000, [eos])
    spec = validate_request(
        {"prompt": "x", "structured_outputs": {"json": W1_JSON_SCHEMA}}
    ).structured_outputs
    grammar = pool.grammar_blocking(spec)
    assert pool.grammar_vocab_size == 512 and grammar.grammar_vocab_size == 512
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=1000, stop_token_ids=[eos])
    whole = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(constraint_ebnf(spec)))
    rng = np.random.default_rng(0)
    for _ in range(120):
        mask, _ = fill_bitmasks([grammar], 1000)
        expected = np.empty((1, 32), dtype=np.int32)
        whole.fill_next_token_bitmask(expected, 0)
        assert mask.shape == (1, 32) and np.array_equal(mask, expected) and not mask[:, 16:].any()
        token = int(rng.choice(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))))
        assert grammar.accept(token) and whole.accept_token(token)
    pool.close()


def test_widened_masks_forbid_the_bits_past_the_tokenizer_in_its_last_word():
    from pagedserve.scheduler.structured import widen_bitmask

    wide = widen_bitmask(np.full((2, 2), -1, dtype=np.int32), 40, 100)
    assert wide.shape == (2, 4) and (wide[:, 0] == -1).all() and (wide[:, 1] == 0xFF).all()
    assert not wide[:, 2:].any()
    same = widen_bitmask(np.full((1, 4), -1, dtype=np.int32), 100, 128)  # as many words: cleared too
    assert same.tolist() == [[-1, -1, -1, 0xF]]
    assert widen_bitmask(np.full((1, 4), -1, dtype=np.int32), 100, 100).tolist() == [[-1] * 4]


def test_matcher_accepts_rolls_back_and_terminates(compiler):
    tokenizer, pool = compiler
    grammar = pool.grammar_blocking(StructuredOutputs("choice", ("ab",)))
    ids = tokenizer.encode("ab", add_special_tokens=False)
    for token in ids:
        assert grammar.accept(token)
    grammar.rollback(len(ids))
    assert grammar.num_accepted == 0
    for token in ids:
        assert grammar.accept(token)
    assert not grammar.is_terminated
    assert grammar.accept(tokenizer.eos_token_id) and grammar.is_terminated
    assert grammar.matcher.is_terminated()  # what is_terminated keeps (not asked per token)
    grammar.rollback(1)  # the stop token taken back
    assert not grammar.is_terminated and not grammar.matcher.is_terminated()
    assert grammar.accept(tokenizer.eos_token_id) and grammar.is_terminated
    with pytest.raises(ValueError):
        grammar.rollback(99)
    other = pool.grammar_blocking(StructuredOutputs("choice", ("ab",)))
    assert not other.accept(tokenizer.encode("zz", add_special_tokens=False)[0]) and other.failed


def test_compile_once_per_constraint_and_refusals_name_the_kind(compiler):
    _, pool = compiler
    spec = StructuredOutputs("regex", "[0-9]{2}")
    before = pool.stats.compiled
    asyncio.run(pool.grammar(spec))
    asyncio.run(pool.grammar(spec))
    assert pool.stats.compiled == before + 1 and pool.stats.cache_hits >= 1
    with pytest.raises(InvalidRequest, match=r"^structured_outputs: grammar: does not compile: EBNF parser"):
        pool.grammar_blocking(StructuredOutputs("grammar", "root ::= ("))
    with pytest.raises(InvalidRequest, match="Lookbehind"):
        pool.grammar_blocking(StructuredOutputs("regex", "(?<=a)b"))


def test_required_tool_calls_schema_keeps_each_functions_references(compiler):
    tokenizer, pool = compiler
    params = {
        "$defs": {"unit": {"enum": ["c", "f"]}},
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/unit"}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "temp", "parameters": params}}]
    plan = plan_tools(tools, "required", False, template_declares_tools=False)
    spec = validate_request(
        {"prompt": "x", "structured_outputs": plan.constraint | {"disable_any_whitespace": True}}
    )
    for text in _sample_outputs(tokenizer, pool, spec.structured_outputs, n=10):
        (call,) = json.loads(text)
        assert call["name"] == "temp"
        jsonschema.validate(call["parameters"], params)


# ---- the scheduling rule ----------------------------------------------------------------------------


class FakeGrammar:
    """A grammar that allows only token 7, for the core's bookkeeping."""

    vocab_size = 64
    grammar_vocab_size = 64  # the matcher's (the tokenizer's tokens): all of them here
    is_terminated = False
    failed = False

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, 0] = 1 << 7


def test_a_constrained_request_never_samples_with_a_token_in_flight():
    core = Scheduler(
        SchedulerConfig(block_size=4, num_gpu_blocks=16, max_model_len=32, max_num_batched_tokens=64)
    )
    grammar = FakeGrammar()
    free = Request(SeqId(1), [1, 2, 3], 6, SamplingOptions())
    constrained = Request(SeqId(2), [4, 5], 6, SamplingOptions(), grammar=grammar)
    core.add_request(free)
    core.add_request(constrained)
    first = core.schedule()  # prefill both; both sample
    assert first.sampling_seq_ids == [1, 2] and first.masked_seq_ids == [2]
    assert first.token_bitmask.shape == (1, 2) and first.token_bitmask[0, 0] == 1 << 7
    second = core.schedule()  # planned before output 1 arrives: only the free request decodes
    assert second.sampling_seq_ids == [1] and not second.masked_seq_ids and second.token_bitmask is None
    core.process_output(first.step_id, [1, 2], [9, 7])
    assert grammar.accepted == [7] and constrained.output_token_ids == [7]
    third = core.schedule()  # both again: the free one with a token in flight, the constrained one without
    assert third.sampling_seq_ids == [1, 2] and third.masked_seq_ids == [2]


def _late_core(shared_mask_rows: bool = False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            block_size=4,
            num_gpu_blocks=16,
            max_model_len=32,
            max_num_batched_tokens=64,
            late_masks=True,
            shared_mask_rows=shared_mask_rows,
        )
    )


def test_with_late_masks_a_constrained_request_samples_in_every_plan():
    """Masks behind the plan: plan 2 is made while output 1 is in flight and schedules the
    constrained request anyway, naming it late; its mask is made once output 1 fed the matcher."""
    core = _late_core()
    grammar = FakeGrammar()
    free = Request(SeqId(1), [1, 2, 3], 6, SamplingOptions())
    constrained = Request(SeqId(2), [4, 5], 6, SamplingOptions(), grammar=grammar)
    core.add_request(free)
    core.add_request(constrained)
    first = core.schedule()  # nothing in flight: the mask comes with the plan
    assert first.masked_seq_ids == [2] and first.late_masked_seq_ids == []
    assert core.fill_late_masks(first) is None
    second = core.schedule()  # output 1 pending: both decode, the constrained one's mask follows
    assert second.sampling_seq_ids == [1, 2] and second.late_masked_seq_ids == [2]
    assert not second.masked_seq_ids and second.token_bitmask is None
    core.process_output(first.step_id, [1, 2], [9, 7])
    masks = core.fill_late_masks(second)
    assert masks.step_id == second.step_id and masks.seq_ids == [2]
    assert masks.token_bitmask.shape == (1, 2) and masks.token_bitmask[0, 0] == 1 << 7
    third = core.schedule()
    assert third.sampling_seq_ids == [1, 2] and third.late_masked_seq_ids == [2]


def test_a_late_masked_request_that_finished_is_left_out_and_its_token_discarded():
    """Its grammar ends with output N while plan N+1 holds it: no mask for it (the executor samples
    that row unmasked), its blocks are freed when it finishes, and plan N+1's token is dropped, as
    for a stop string found one plan late."""
    core = _late_core()
    grammar = FakeGrammar()
    request = Request(SeqId(2), [4, 5], 6, SamplingOptions(), grammar=grammar)
    core.add_request(request)
    first, second = core.schedule(), core.schedule()
    assert second.late_masked_seq_ids == [2]
    core.process_output(first.step_id, [2], [7])
    grammar.is_terminated = True  # the token ended the grammar: the engine finishes the request
    core.abort_request(SeqId(2))
    assert core.kv_cache_manager.block_pool.num_blocks_in_use == 0
    masks = core.fill_late_masks(second)
    assert masks.seq_ids == [] and masks.token_bitmask.size == 0
    assert core.process_output(second.step_id, [2], [11]) == []  # discarded
    assert request.output_token_ids == [7] and grammar.accepted == [7]
    assert core.schedule().removed_seq_ids == [2]


def test_shared_rows_send_each_distinct_mask_once_and_only_where_exact(monkeypatch):
    from pagedserve.scheduler import structured

    rows = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.int32)
    distinct, index = structured.share_rows(rows)
    assert index == [0, 1, 0, 0, 1] and np.array_equal(distinct, rows[:2])
    assert structured.share_rows(rows[:2])[1] == [] and structured.share_rows(rows[:1])[1] == []
    odd = rows[:, :3].copy()  # an odd number of words: fingerprinted as 32-bit words
    assert structured.share_rows(odd)[1] == [0, 1, 0, 0, 1]
    # Different rows with one fingerprint: nothing is shared (the grouping is checked exactly).
    monkeypatch.setattr(structured, "_fingerprint_weights", lambda width, dtype: np.zeros(width, dtype))
    distinct, index = structured.share_rows(rows)
    assert index == [] and distinct is rows
    assert structured.share_rows(rows[[0, 2]])[1] == [0, 0]


def test_with_shared_rows_the_plan_and_its_late_masks_carry_each_distinct_mask_once():
    """Two constrained requests in the same grammar state (the fake's one mask): one row, named
    by both, in the plan and behind the next one, and on the wire."""
    from pagedserve.scheduler.replica import masks_to_proto

    core = _late_core(shared_mask_rows=True)
    grammars = [FakeGrammar(), FakeGrammar()]
    for seq_id, grammar in zip((1, 2), grammars, strict=True):
        core.add_request(Request(SeqId(seq_id), [4, 5], 6, SamplingOptions(), grammar=grammar))
    first = core.schedule()
    assert first.masked_seq_ids == [1, 2] and first.mask_rows == [0, 0]
    assert first.token_bitmask.shape == (1, 2) and first.token_bitmask[0, 0] == 1 << 7
    second = core.schedule()
    core.process_output(first.step_id, [1, 2], [7, 7])
    masks = core.fill_late_masks(second)
    assert masks.seq_ids == [1, 2] and masks.rows == [0, 0] and masks.token_bitmask.shape == (1, 2)
    message = masks_to_proto(masks).masks
    assert list(message.rows) == [0, 0] and len(message.token_bitmask) == 8
    unshared = _late_core()
    unshared.add_request(Request(SeqId(1), [4, 5], 6, SamplingOptions(), grammar=FakeGrammar()))
    unshared.add_request(Request(SeqId(2), [4, 5], 6, SamplingOptions(), grammar=FakeGrammar()))
    plan = unshared.schedule()  # an executor that does not take shared rows: one row each
    assert plan.mask_rows == [] and plan.token_bitmask.shape == (2, 2)


def test_a_plan_without_constrained_requests_carries_no_mask():
    core = Scheduler(
        SchedulerConfig(block_size=4, num_gpu_blocks=16, max_model_len=32, max_num_batched_tokens=64)
    )
    core.add_request(Request(SeqId(1), [1, 2, 3], 4, SamplingOptions()))
    plan = core.schedule()
    assert plan.sampling_seq_ids == [1] and plan.masked_seq_ids == [] and plan.token_bitmask is None
    assert core.mask_seconds == []


# ---- the executor -------------------------------------------------------------------------------


def _mask(vocab: int, allowed: list[list[int]]) -> torch.Tensor:
    bits = np.zeros((len(allowed), (vocab + 31) // 32 * 32), dtype=np.uint8)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = 1
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


def test_masked_rows_sample_only_allowed_tokens_and_others_are_untouched():
    vocab = 70
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 4
    masks = TokenMasks(torch.tensor([0, 2]), _mask(vocab, [[3, 64], [69]]))
    params = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=2.0, top_k=5)]
    for position in range(50):
        out = sample(logits, params, [position] * 3, masks=masks)
        assert int(out.token_ids[0]) in (3, 64) and int(out.token_ids[2]) == 69
        assert int(out.token_ids[1]) == int(logits[1].argmax())
    masked = apply_token_masks(logits, masks)
    assert torch.equal(masked[1], logits[1]) and torch.isinf(masked[0]).sum() == vocab - 2


def _limits(vocab: int = 64) -> PlanLimits:
    return PlanLimits(
        vocab_size=vocab, max_model_len=32, block_size=4, max_blocks_per_seq=8, num_device_blocks=16,
        num_cpu_blocks=0, max_num_batched_tokens=64, max_num_seqs=4, max_held_requests=4,
    )  # fmt: skip


def _plan(**masks) -> executor_pb2.StepPlan:
    new = executor_pb2.NewRequest(
        seq_id=1, token_ids=[1, 2, 3], num_new_tokens=3, block_tables=[executor_pb2.BlockTable(block_ids=[0])]
    )
    chunk = executor_pb2.NewRequest(
        seq_id=2, token_ids=[1, 2, 3], num_new_tokens=2, block_tables=[executor_pb2.BlockTable(block_ids=[1])]
    )
    return executor_pb2.StepPlan(step_id=0, new_requests=[new, chunk], **masks)


def test_plan_check_takes_masks_only_for_sampling_rows_of_the_right_size():
    validate_plan(_plan(masked_seq_ids=[1], token_bitmask=bytes(8)), {}, _limits())
    with pytest.raises(PlanError, match="does not sample"):
        validate_plan(_plan(masked_seq_ids=[2], token_bitmask=bytes(8)), {}, _limits())
    with pytest.raises(PlanError, match="token_bitmask: 4 bytes"):
        validate_plan(_plan(masked_seq_ids=[1], token_bitmask=bytes(4)), {}, _limits())
    with pytest.raises(PlanError, match="twice"):
        validate_plan(_plan(masked_seq_ids=[1, 1], token_bitmask=bytes(16)), {}, _limits())


def test_plan_check_takes_late_masks_for_sampling_rows_and_their_masks_for_them_only():
    validate_plan(_plan(late_masked_seq_ids=[1]), {}, _limits())
    with pytest.raises(PlanError, match="late_masked_seq_ids: seq_id=2 does not sample"):
        validate_plan(_plan(late_masked_seq_ids=[2]), {}, _limits())
    with pytest.raises(PlanError, match="also has a mask"):
        validate_plan(
            _plan(late_masked_seq_ids=[1], masked_seq_ids=[1], token_bitmask=bytes(8)), {}, _limits()
        )
    late = executor_pb2.StepMasks(step_id=4, seq_ids=[1], token_bitmask=bytes(8))
    validate_masks(late, 4, [1, 3], 64)
    validate_masks(executor_pb2.StepMasks(step_id=4), 4, [1, 3], 64)  # all finished meanwhile
    with pytest.raises(PlanError, match="masks for step 4, but step 5 awaits"):
        validate_masks(late, 5, [1], 64)
    with pytest.raises(PlanError, match="seq_id=1 is not in its late_masked_seq_ids"):
        validate_masks(late, 4, [3], 64)
    with pytest.raises(PlanError, match="8 bytes, 1 masks of vocab_size 96 take 12"):
        validate_masks(late, 4, [1], 96)


def test_plan_check_takes_shared_mask_rows_one_per_mask_within_the_bitmask():
    validate_plan(_plan(masked_seq_ids=[1], token_bitmask=bytes(8), mask_rows=[0]), {}, _limits())
    with pytest.raises(PlanError, match="mask_rows: 2 row indexes for 1 masks"):
        validate_plan(_plan(masked_seq_ids=[1], token_bitmask=bytes(8), mask_rows=[0, 0]), {}, _limits())
    with pytest.raises(PlanError, match="token_bitmask: 8 bytes, 2 masks"):
        validate_plan(_plan(masked_seq_ids=[1], token_bitmask=bytes(8), mask_rows=[1]), {}, _limits())
    shared = executor_pb2.StepMasks(step_id=4, seq_ids=[1, 3], token_bitmask=bytes(8), rows=[0, 0])
    validate_masks(shared, 4, [1, 3], 64)
    with pytest.raises(PlanError, match="rows: 1 row indexes for 2 masks"):
        validate_masks(
            executor_pb2.StepMasks(step_id=4, seq_ids=[1, 3], token_bitmask=bytes(8), rows=[0]), 4, [1, 3], 64
        )
    with pytest.raises(PlanError, match="8 bytes, 2 masks of vocab_size 64 take 16"):
        validate_masks(
            executor_pb2.StepMasks(step_id=4, seq_ids=[1, 3], token_bitmask=bytes(8), rows=[0, 1]),
            4,
            [1, 3],
            64,
        )


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    config = ExecutorConfig(
        model=str(tiny_model_dir),
        device="cpu",
        num_gpu_blocks_override=16,
        max_model_len=256,
        swap_space=0.002,
    )
    return ModelRunner.create(config)


def _decode(seq_ids: list[int], step_id: int, **fields) -> executor_pb2.StepPlan:
    running = [executor_pb2.RunningRequest(seq_id=s, num_new_tokens=1) for s in seq_ids]
    return executor_pb2.StepPlan(step_id=step_id, running=running, **fields)


def _prefill(step_id: int) -> executor_pb2.StepPlan:
    new = [
        executor_pb2.NewRequest(
            seq_id=s, token_ids=[5 + s, 17, 99, 3], num_new_tokens=4,
            block_tables=[executor_pb2.BlockTable(block_ids=[s])],
        )
        for s in (1, 2)
    ]  # fmt: skip
    return executor_pb2.StepPlan(step_id=step_id, new_requests=new)


def test_runner_samples_a_late_masked_step_once_its_masks_arrive(runner):
    """Plan 2 is launched (its forward queued) before step 1 is finished and names seq 1 late:
    step 1 finishes as usual, plan 3 is refused until plan 2 has its masks, and then seq 1 samples
    within its mask while seq 2 samples as in a run without masks."""
    runner.reset()
    reference = [runner.execute(_prefill(1)), runner.execute(_decode([1, 2], 2))]
    greedy = dict(zip(reference[1].seq_ids, reference[1].token_ids, strict=True))
    allowed = (greedy[1] + 1) % 512  # not what seq 1 would sample: only the mask makes it
    runner.reset()
    first = runner.launch(_prefill(1))
    second = runner.launch(_decode([1, 2], 2, late_masked_seq_ids=[1]))
    assert second.awaits_masks and not second.ready()
    assert list(runner.finish(first).token_ids) == list(reference[0].token_ids)
    with pytest.raises(PlanError, match="plan 3 arrived while step 2 awaits its late masks"):
        runner.launch(_decode([1, 2], 3))
    with pytest.raises(PlanError, match="not in its late_masked_seq_ids"):
        runner.apply_masks(second, executor_pb2.StepMasks(step_id=2, seq_ids=[2], token_bitmask=bytes(64)))
    mask = _mask(512, [[allowed]]).numpy().tobytes()
    runner.apply_masks(second, executor_pb2.StepMasks(step_id=2, seq_ids=[1], token_bitmask=mask))
    out = runner.finish(second)
    assert dict(zip(out.seq_ids, out.token_ids, strict=True)) == {1: allowed, 2: greedy[2]}
    runner.execute(_decode([1, 2], 3))  # the next step reads the masked token: it runs


def test_runner_expands_shared_mask_rows_to_each_request(runner):
    """One mask sent for two late-masked requests (StepMasks.rows): both sample within it."""
    runner.reset()
    runner.finish(runner.launch(_prefill(1)))
    second = runner.launch(_decode([1, 2], 2, late_masked_seq_ids=[1, 2]))
    mask = _mask(512, [[42]]).numpy().tobytes()
    runner.apply_masks(
        second, executor_pb2.StepMasks(step_id=2, seq_ids=[1, 2], token_bitmask=mask, rows=[0, 0])
    )
    out = runner.finish(second)
    assert dict(zip(out.seq_ids, out.token_ids, strict=True)) == {1: 42, 2: 42}


def test_runner_reset_samples_a_step_whose_masks_never_came(runner):
    """A stream that ends while a step awaits its masks: a reset (the next lease) samples it
    without them and forgets it, so the runner takes plans again."""
    runner.reset()
    runner.finish(runner.launch(_prefill(1)))
    orphan = runner.launch(_decode([1, 2], 2, late_masked_seq_ids=[1, 2]))
    runner.reset()
    assert not orphan.awaits_masks
    assert len(runner.execute(_prefill(1)).seq_ids) == 2


# ---- tool calls -----------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _feed_in_pieces(parser: ToolCallParser, text: str, size: int):
    pieces = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    return "".join(p.content for p in pieces), merge_calls([c for p in pieces for c in p.calls])


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_calls_are_found_however_the_text_is_split(size):
    text = (
        'Let me look. <tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        '<tool_call>{"name": "weather", "arguments": {"city": "<x>"}}</tool_call> done <tool'
    )
    content, calls = _feed_in_pieces(ToolCallParser(plan_tools([WEATHER], "auto", None, True)), text, size)
    assert content == "Let me look.  done <tool"
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "weather", {"city": "Oslo"}),
        (1, "weather", {"city": "<x>"}),
    ]
    assert all(c.id.startswith("call_") for c in calls)


def test_a_broken_hermes_call_stays_text():
    parser = ToolCallParser(plan_tools([WEATHER], "auto", None, True))
    content, calls = _feed_in_pieces(parser, "<tool_call>{not json}</tool_call>", 4)
    assert calls == [] and content == "<tool_call>{not json}</tool_call>"


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_required_calls_are_given_as_each_one_closes(size):
    text = '[{"name": "weather", "parameters": {"city": "a}\\"]"}}, {"name": "weather", "parameters": {}}]'
    parser = ToolCallParser(plan_tools([WEATHER], "required", None, False))
    content, calls = _feed_in_pieces(parser, text, size)
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"city": 'a}"]'}, {}]


def test_named_calls_stream_their_arguments():
    named = {"type": "function", "function": {"name": "weather"}}
    parser = ToolCallParser(plan_tools([WEATHER], named, None, False))
    first, second = parser.feed('{"city": '), parser.feed('"Oslo"}')
    assert first.calls[0].name == "weather" and first.calls[0].id and second.calls[0].id is None
    assert first.calls[0].arguments + second.calls[0].arguments == '{"city": "Oslo"}'


@pytest.mark.parametrize(
    ("tools", "choice", "declares", "param"),
    [
        (None, "required", True, "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "x"}}, True, "tool_choice"),
        ([WEATHER], "auto", False, "tool_choice"),
        ([WEATHER], "sometimes", True, "tool_choice"),
        ([WEATHER, WEATHER], "required", True, "tools.1.function.name"),
    ],
)
def test_tool_choices_that_cannot_be_served(tools, choice, declares, param):
    with pytest.raises(ToolChoiceError) as info:
        plan_tools(tools, choice, None, declares)
    assert info.value.param == param


# ---- the gateway's body forms ---------------------------------------------------------------------


def test_the_gateways_constraint_fields_become_one_constraint():
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    def values(**body):
        request = CompletionRequest.model_validate({"prompt": "x", **body})
        return request.request_values()["structured_outputs"], request.aliases()

    schema = {"type": "object"}
    assert values(guided_json=schema, structured_outputs={"disable_any_whitespace": True}) == (
        {"json": schema, "disable_any_whitespace": True},
        {"structured_outputs": "guided_json"},
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert values(response_format=fmt)[0] == {"json": schema}
    assert values(response_format={"type": "text"}) == (None, {})
    # Options with nothing to apply to are a constraint of no kind: refused, as at every door.
    assert values(structured_outputs={"disable_any_whitespace": True})[0] == {"disable_any_whitespace": True}
    with pytest.raises(InvalidRequest) as info:
        values(guided_regex="a", guided_choice=["b"])
    assert info.value.field == "guided_choice" and "guided_regex" in info.value.reason
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "structured_outputs": {"disable_any_whitespace": True},
        }
    )
    assert chat.request_values()["structured_outputs"] is None
    assert chat.constraint_options() == {"disable_any_whitespace": True}


def test_proposals_are_cut_where_the_grammar_stops_allowing_them(compiler):
    """Speculative decoding: n-gram proposals keep their longest allowed prefix, short of the token
    that would end the grammar; masks follow each proposal; the matcher is left as it was."""
    from pagedserve.scheduler.structured import fill_bitmasks_along

    tokenizer, pool = compiler
    grammar = pool.grammar_blocking(StructuredOutputs("choice", ("abab cd",)))
    ids = tokenizer.encode("abab cd", add_special_tokens=False)
    assert grammar.accept(ids[0])
    rest, eos, wrong = ids[1:], tokenizer.eos_token_id, tokenizer.encode("zz", add_special_tokens=False)[0]
    assert grammar.allowed_prefix([*rest, eos]) == rest  # not the EOS that would end it
    assert grammar.allowed_prefix([rest[0], wrong, *rest[1:]]) == rest[:1]
    assert grammar.num_accepted == 1 and not grammar.failed
    masks = fill_bitmasks_along([grammar], [rest], 512)
    assert len(masks) == len(rest) + 1
    for row, token in enumerate([*rest, eos]):  # each row allows the next token of the choice
        allowed = np.flatnonzero(np.unpackbits(masks[row : row + 1].view(np.uint8), bitorder="little"))
        assert token in allowed, row
    assert grammar.allowed_prefix(rest) == rest  # unchanged by the masks
