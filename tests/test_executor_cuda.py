"""The executor on CUDA (skipped without a GPU): CUDA graphs vs eager vs Hugging Face, padding rows,
and no host synchronisation while a decode or swap step is launched."""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.runner import ModelRunner
from pagedserve.tiny_model import TinyModelSpec, write_tiny_model
from tests.toy_scheduler import AheadScheduler, ToyScheduler, drive_ahead

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
transformers = pytest.importorskip("transformers")

NUM_BLOCKS = 128
MAX_NEW = 24


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# 5 prompts admitted over two steps (budget 64), mixed with the first decodes (mixed graphs); then
# decode-only steps of 5 sequences replay the decode graph of 8.
PROMPTS = {i: _prompt(n, seed=i) for i, n in enumerate((21, 40, 7, 33, 16), start=1)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-cuda"), TinyModelSpec())


def _runner(model_dir, dtype: str, eager: bool) -> ModelRunner:
    config = ExecutorConfig(
        model=str(model_dir), device="cuda", dtype=dtype, num_gpu_blocks_override=NUM_BLOCKS,
        swap_space=0.002, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=eager,
    )  # fmt: skip
    return ModelRunner.create(config)


def _generate(runner: ModelRunner) -> dict[int, list[int]]:
    runner.reset()
    sched = AheadScheduler(NUM_BLOCKS, runner.block_size, max_num_batched_tokens=64, max_num_seqs=8)
    for seq_id, prompt in PROMPTS.items():
        sched.add(seq_id, prompt)
    drive_ahead(runner, sched, steps=MAX_NEW + 6)
    return {s: out[:MAX_NEW] for s, out in sched.outputs.items()}


def _hf_greedy(model_dir, device: str) -> dict[int, list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None  # compare fixed-length generations
    out = {}
    for seq_id, prompt in PROMPTS.items():
        ids = hf.generate(
            torch.tensor([prompt], device=device), max_new_tokens=MAX_NEW, do_sample=False,
            pad_token_id=0, min_length=0,
        )  # fmt: skip
        out[seq_id] = ids[0, len(prompt) :].tolist()
    return out


def test_float32_graphs_and_eager_match_hf_on_cuda(model_dir):
    expected = _hf_greedy(model_dir, "cuda")
    eager = _runner(model_dir, "float32", eager=True)
    assert eager.graphs is None
    assert _generate(eager) == expected
    graphs = _runner(model_dir, "float32", eager=False)
    assert graphs.graphs is not None
    assert graphs.graphs.decode_sizes == [1, 2, 4, 8]
    assert graphs.graphs.mixed_sizes == [64]
    assert _generate(graphs) == expected
    assert graphs.stats.graph_steps == graphs.stats.steps
    assert eager.stats.graph_steps == 0


def test_bfloat16_graphs_match_eager(model_dir):
    """bf16 rounding may differ between a padded graph and an eager step (other GEMM and split-KV
    shapes), so one sequence may drift after a near tie; most tokens must agree."""
    eager = _generate(_runner(model_dir, "bfloat16", eager=True))
    graphs = _generate(_runner(model_dir, "bfloat16", eager=False))
    same = sum(a == b for s in PROMPTS for a, b in zip(eager[s], graphs[s], strict=True))

    def common_prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))

    prefix = sum(common_prefix(eager[s], graphs[s]) for s in PROMPTS)
    print(f"\nbf16 graphs vs eager: {same}/{len(PROMPTS) * MAX_NEW} tokens equal, common prefixes {prefix}")
    assert prefix >= len(PROMPTS) * MAX_NEW // 2


def test_graph_padding_rows_write_no_kv(model_dir):
    runner = _runner(model_dir, "float32", eager=False)
    sched = ToyScheduler(NUM_BLOCKS, 0, runner.block_size, seed=3)
    for seq_id, n in ((1, 17), (2, 5), (3, 33)):
        sched.add(seq_id, _prompt(n, seed=seq_id))
    sched.observe(runner.execute(sched.plan()))
    before = runner.kv_cache.device_pool.clone()
    steps = runner.stats.graph_steps
    sched.observe(runner.execute(sched.plan()))  # 3 decodes: the graph of 4
    assert runner.stats.graph_steps == steps + 1
    changed = (runner.kv_cache.device_pool != before).flatten(0, 1).any(dim=(0, 2, 3, 4))
    positions = {s: len(sched.seqs[s].token_ids) - 2 for s in (1, 2, 3)}  # the token just computed
    expected = {sched.seqs[s].block_ids[p // runner.block_size] for s, p in positions.items()}
    assert set(torch.nonzero(changed).flatten().tolist()) == expected


@pytest.mark.parametrize("eager", [False, True])
def test_decode_launch_never_waits_for_the_device(model_dir, eager):
    """torch raises on any synchronising call (.item(), .tolist(), pageable copies...), in decode
    steps and in steps that mix decodes with newly admitted prompts."""
    runner = _runner(model_dir, "bfloat16", eager=eager)
    runner.reset()
    sched = AheadScheduler(NUM_BLOCKS, runner.block_size, max_num_batched_tokens=64, max_num_seqs=8)
    for seq_id, prompt in PROMPTS.items():
        sched.add(seq_id, prompt)
    first = runner.launch(sched.plan())  # prefills (may allocate, compile)
    second = runner.launch(sched.plan())  # decode, launched before the prefill step finished
    sched.observe(runner.finish(first))
    pending = [second]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            pending.append(runner.launch(sched.plan()))
            ready = pending.pop(0)
            torch.cuda.set_sync_debug_mode("default")
            sched.observe(runner.finish(ready))  # waits for the step, as the service does
            torch.cuda.set_sync_debug_mode("error")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (runner.stats.graph_steps > 0) != eager


def test_swap_steps_never_wait_and_keep_greedy_exact(model_dir):
    """Steps that swap a sequence's KV out and back in launch without a host sync (torch raises on
    any), and the swapped sequence's greedy tokens still equal Hugging Face's."""
    runner = _runner(model_dir, "float32", eager=False)
    runner.reset()
    sched = ToyScheduler(NUM_BLOCKS, runner.kv_cache.num_cpu_blocks, runner.block_size, seed=3)
    for seq_id, prompt in PROMPTS.items():
        sched.add(seq_id, prompt)
    sched.observe(runner.execute(sched.plan({1: len(PROMPTS[1]), 2: len(PROMPTS[2])})))  # within budget 64
    for _ in range(2):  # the other prompts with the first decodes, then decodes only
        sched.observe(runner.execute(sched.plan()))
    others = {seq_id: 1 for seq_id in PROMPTS if seq_id != 1}
    for num_new, swap_out, swap_in in ((others, [1], []), (others, [], []), ({**others, 1: 1}, [], [1])):
        plan = sched.plan(num_new, swap_out=swap_out, swap_in=swap_in)
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = runner.launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sched.observe(runner.finish(pending))
    assert runner.stats.swap_out_blocks == runner.stats.swap_in_blocks == 2
    while min(len(seq.generated) for seq in sched.seqs.values()) < MAX_NEW:
        sched.observe(runner.execute(sched.plan()))
    expected = _hf_greedy(model_dir, "cuda")
    for seq_id in PROMPTS:
        assert sched.seqs[seq_id].generated[:MAX_NEW] == expected[seq_id], seq_id


def test_tier_copies_on_the_copy_stream_are_bit_identical(model_dir):
    """The CPU tier's offload / load moves on the copy stream, beside another request's forward:
    the loaded blocks are the computed ones, bit for bit (tests.test_kv_tier.round_trip)."""
    from tests.test_kv_tier import round_trip

    config = ExecutorConfig(
        model=str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=16, swap_space=0.0,
        kv_offloading_size=0.001, max_model_len=128, enforce_eager=True,
    )  # fmt: skip
    round_trip(ModelRunner.create(config), beside=True)


def test_disk_tier_spills_wait_for_the_copy_stream_and_are_bit_identical(model_dir, tmp_path):
    """A block offloaded on the copy stream, spilled to the disk tier by the next plan (which must
    wait for that copy), fetched and loaded back: bit for bit (tests.test_kv_disk_tier)."""
    from tests.test_kv_disk_tier import disk_round_trip

    config = ExecutorConfig(
        model=str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=16, swap_space=0.0,
        kv_offloading_size=0.001, kv_offloading_disk=str(tmp_path), kv_offloading_disk_size=0.001,
        max_model_len=128, enforce_eager=True,
    )  # fmt: skip
    disk_round_trip(ModelRunner.create(config))


def test_tier_loads_and_offloads_beside_the_steps_keep_greedy_exact(model_dir):
    """Multi-turn prompts whose histories exceed the GPU pool: with the tier (loads a plan before
    the prefill, offloads ahead of eviction, both on the copy stream) the greedy tokens equal the
    run without it, and the tier serves a part of the prompts."""
    from pagedserve import LLM, SamplingParams

    histories = {i: _prompt(48, seed=10 + i) for i in range(6)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def turns(tier_gib: float) -> tuple[list[list[int]], int]:
        llm = LLM(
            str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=24,
            max_model_len=256, max_num_seqs=4, kv_offloading_size=tier_gib,
        )  # fmt: skip
        tokens, cached, history = [], 0, dict(histories)
        try:
            for turn in range(3):
                prompts = [{"prompt_token_ids": history[i]} for i in sorted(history)]
                outputs = llm.generate(prompts, params, use_tqdm=False)
                for i, out in zip(sorted(history), outputs, strict=True):
                    tokens.append(out.outputs[0].token_ids)
                    cached += out.num_cached_tokens or 0
                    history[i] = history[i] + out.outputs[0].token_ids + _prompt(16, seed=100 * turn + i)
        finally:
            llm.shutdown()
        return tokens, cached

    without, cached_without = turns(0.0)
    with_tier, cached_with = turns(0.01)
    assert with_tier == without
    assert cached_with > cached_without
