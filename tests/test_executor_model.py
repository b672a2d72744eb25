"""Our forward pass and step engine against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.loader import UnsupportedModelError, load_model_spec
from pagedserve.executor.runner import ModelRunner, PlanError, build_step_inputs
from pagedserve.protos import executor_pb2
from pagedserve.tiny_model import TinyModelSpec, write_tiny_model
from tests.toy_scheduler import ToyScheduler

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
SPECS = {
    "llama_gqa": TinyModelSpec(),
    "llama_mha_tied": TinyModelSpec(num_key_value_heads=4, tie_word_embeddings=True, seed=1),
    "qwen2": TinyModelSpec(model_type="qwen2", seed=2),
    "mistral": TinyModelSpec(model_type="mistral", seed=3),
    "llama3_rope_head_dim": TinyModelSpec(head_dim=32, rope_scaling=LLAMA3_ROPE, seed=4),
}
NUM_BLOCKS = 64


@pytest.fixture(scope="module", params=list(SPECS))
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), SPECS[request.param])


@pytest.fixture(scope="module")
def hf_reference(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare fixed-length generations
    return model


@pytest.fixture(scope="module")
def runner(model_dir):
    config = ExecutorConfig(
        model=str(model_dir), device="cpu", num_gpu_blocks_override=NUM_BLOCKS, swap_space=0.002
    )
    return ModelRunner.create(config)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_spec_reads_checkpoint_variants(model_dir):
    spec = load_model_spec(model_dir)
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    assert spec.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert spec.qkv_bias == (hf.model_type == "qwen2")
    assert spec.eos_token_ids == (2,)


def test_prompt_logits_match_hf(runner, hf_reference):
    prompt = _prompt(37, seed=0)
    with torch.no_grad():
        expected = hf_reference(torch.tensor([prompt])).logits[0]
    # A shuffled, non-contiguous block table.
    inputs = build_step_inputs([prompt], [0], [[41, 7, 19]], [True], runner.block_size, runner.device)
    logits = runner.model(
        inputs.input_ids, inputs.meta, runner.kv_cache.layer_caches(), torch.arange(len(prompt))
    )
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def _hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0, min_length=0
    )
    return out[0, len(prompt) :].tolist()


def _run(runner: ModelRunner, scheduler: ToyScheduler, plan: executor_pb2.StepPlan) -> dict[int, int]:
    return scheduler.observe(runner.execute(plan))


def test_chunked_batched_greedy_matches_hf_generate(runner, hf_reference):
    runner.reset()
    prompts = {11: _prompt(21, seed=1), 22: _prompt(35, seed=2)}
    max_new = 20  # seq 11 ends at 41 tokens: mid-block
    sched = ToyScheduler(NUM_BLOCKS, 0, runner.block_size, seed=3)
    for seq_id, prompt in prompts.items():
        sched.add(seq_id, prompt)
    assert _run(runner, sched, sched.plan({11: 10, 22: 16})) == {}  # first prefill chunks
    assert set(_run(runner, sched, sched.plan({11: 11, 22: 19}))) == {11, 22}  # rest of prefills
    while len(sched.seqs[22].generated) < max_new:
        _run(runner, sched, sched.plan())
    for seq_id, prompt in prompts.items():
        assert sched.seqs[seq_id].generated == _hf_greedy(hf_reference, prompt, max_new), seq_id
    assert runner.stats.tokens_sampled == 2 * max_new


def test_swap_out_and_in_round_trips_kv(runner, hf_reference):
    """Seq 1 is swapped out mid-generation, its GPU blocks get reused by seq 3, then it is swapped back
    into other blocks and resumed with all-but-its-last token computed."""
    runner.reset()
    sched = ToyScheduler(NUM_BLOCKS, runner.kv_cache.num_cpu_blocks, runner.block_size, seed=4)
    prompt = _prompt(30, seed=5)
    sched.add(1, prompt)
    sched.add(2, _prompt(9, seed=6))
    for _ in range(6):
        _run(runner, sched, sched.plan())
    _run(runner, sched, sched.plan({2: 1}, swap_out=[1]))
    sched.add(3, _prompt(40, seed=7))  # takes the blocks seq 1 released
    _run(runner, sched, sched.plan({2: 1, 3: 40}))
    plan = sched.plan({1: 1, 2: 1, 3: 1}, swap_in=[1])
    assert plan.new_requests[0].num_computed_tokens == len(plan.new_requests[0].token_ids) - 1
    _run(runner, sched, plan)
    while len(sched.seqs[1].generated) < 16:
        _run(runner, sched, sched.plan({1: 1, 2: 1, 3: 1}))
    assert sched.seqs[1].generated == _hf_greedy(hf_reference, prompt, 16)


def test_recompute_after_removal(runner, hf_reference):
    runner.reset()
    sched = ToyScheduler(NUM_BLOCKS, 0, runner.block_size, seed=5)
    prompt = _prompt(18, seed=8)
    sched.add(5, prompt)
    for _ in range(4):
        _run(runner, sched, sched.plan())
    # Pre-empted by recompute: dropped, then re-sent with prompt + generated tokens, in two chunks.
    _run(runner, sched, sched.plan({}, remove=[5]))
    known = len(sched.seqs[5].token_ids)
    _run(runner, sched, sched.plan({5: known - 7}))
    _run(runner, sched, sched.plan({5: 7}))
    while len(sched.seqs[5].generated) < 10:
        _run(runner, sched, sched.plan())
    assert sched.seqs[5].generated == _hf_greedy(hf_reference, prompt, 10)


def _bad(runner: ModelRunner, plan: executor_pb2.StepPlan, match: str) -> None:
    before = runner.num_requests
    with pytest.raises(PlanError, match=match):
        runner.execute(plan)
    assert runner.num_requests == before  # nothing applied


@pytest.mark.parametrize("model_dir", ["llama_gqa"], indirect=True)
def test_bad_plans_are_rejected_whole(runner):
    runner.reset()
    ok = executor_pb2.NewRequest(
        seq_id=1,
        token_ids=[5] * 20,
        num_new_tokens=20,
        block_tables=[executor_pb2.BlockTable(block_ids=[3, 4])],
    )
    runner.execute(executor_pb2.StepPlan(new_requests=[ok]))
    new = executor_pb2.NewRequest
    running = executor_pb2.RunningRequest
    _bad(runner, executor_pb2.StepPlan(running=[running(seq_id=9, num_new_tokens=1)]), "unknown")
    _bad(runner, executor_pb2.StepPlan(new_requests=[ok]), "already held")
    _bad(runner, executor_pb2.StepPlan(running=[running(seq_id=1, num_new_tokens=2)]), "exceeds")
    _bad(
        runner,
        executor_pb2.StepPlan(
            new_requests=[
                new(
                    seq_id=2,
                    token_ids=[5] * 17,
                    num_new_tokens=17,
                    block_tables=[executor_pb2.BlockTable(block_ids=[8])],
                )
            ]
        ),
        "cannot hold",
    )
    _bad(
        runner,
        executor_pb2.StepPlan(
            new_requests=[
                new(
                    seq_id=2,
                    token_ids=[5],
                    num_new_tokens=1,
                    block_tables=[executor_pb2.BlockTable(block_ids=[NUM_BLOCKS])],
                )
            ]
        ),
        "out of range",
    )
    _bad(runner, executor_pb2.StepPlan(swap_in=[executor_pb2.BlockMove(src=10**6, dst=0)]), "out of range")
    _bad(
        runner,
        executor_pb2.StepPlan(
            new_requests=[
                new(
                    seq_id=2,
                    token_ids=[10**6],
                    num_new_tokens=1,
                    block_tables=[executor_pb2.BlockTable(block_ids=[8])],
                )
            ]
        ),
        "vocab_size",
    )
    # A valid follow-up still works: the rejected plans left no trace.
    out = runner.execute(
        executor_pb2.StepPlan(
            running=[
                running(
                    seq_id=1,
                    num_new_tokens=1,
                    new_blocks=[executor_pb2.BlockTable(first_index=2, block_ids=[9])],
                )
            ]
        )
    )
    assert list(out.seq_ids) == [1]


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model_spec(tmp_path)


@pytest.mark.parametrize("model_dir", ["llama_gqa"], indirect=True)
def test_pool_too_small_for_max_model_len_fails_at_startup(model_dir):
    config = ExecutorConfig(model=str(model_dir), device="cpu", num_gpu_blocks_override=4, max_model_len=100)
    with pytest.raises(RuntimeError, match="largest length that fits is 64"):
        ModelRunner.create(config)
