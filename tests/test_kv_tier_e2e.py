"""The CPU tier end to end (real executor and scheduler processes, CPU, float32): multi-turn
conversations (the W6 workload's shape, scaled down) whose histories exceed the GPU pool but fit the
tier. With the tier every history is computed once (later turns load it back), the greedy tokens
equal the run without it and Hugging Face's, swap pre-emption shares the host pool with the tier,
and an executor killed while it offloads loses no token. A small CPU tier over a disk tier does as
well as a large one."""

from __future__ import annotations

import math
import threading
import time

import pytest

from pagedserve.bench.client import SendOptions, run_pass
from pagedserve.bench.workloads import LengthRange, Workload, generate_requests
from tests.services import hf_greedy, running_services, scheduler_stats, wait_for_idle

pytestmark = pytest.mark.slow

BS, USER_TOKENS, ANSWER_TOKENS, TURNS, CONVERSATIONS = 16, 40, 56, 3, 8
WORKLOAD = Workload(
    dataset="multi-turn",
    num_prompts=CONVERSATIONS,
    num_turns=TURNS,
    input_len=LengthRange(USER_TOKENS, USER_TOKENS),
    output_len=LengthRange(ANSWER_TOKENS, ANSWER_TOKENS),
)
# A sixth of the histories at their longest (8 x 288 tokens = 144 blocks) on the GPU, three
# conversations running at a time (growing by 56 tokens each while they answer, so they pre-empt
# each other); the host pool holds the swap pool and a tier for all of them.
EXECUTOR = ("--num-gpu-blocks-override=20", "--max-model-len=320", "--max-num-seqs=3", "--swap-space=0.001")
TIER = ("--kv-offloading-size=0.002",)  # 8 KiB blocks: 256 of them
SCHEDULER = ("--max-num-seqs=3", "--preemption-mode=swap")


def _run(services):
    requests = generate_requests(WORKLOAD, vocab_size=512)
    result = run_pass(f"127.0.0.1:{services.port}", requests, math.inf, SendOptions(), "w6")
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok][:3]
    after = wait_for_idle(services)
    return requests, result, after


@pytest.fixture(scope="module")
def without_tier(tiny_model_dir, tmp_path_factory):
    with running_services(tiny_model_dir, tmp_path_factory.mktemp("off"), EXECUTOR, SCHEDULER) as services:
        return _run(services)


def test_every_history_is_computed_once_and_tokens_equal_the_run_without(
    tiny_model_dir, tmp_path, without_tier, hf_model
):
    with running_services(tiny_model_dir, tmp_path, (*EXECUTOR, *TIER), SCHEDULER) as services:
        requests, result, stats = _run(services)
        listed = {e.address: e for e in _executors(services)}
    _, baseline, stats_off = without_tier
    assert [r.token_ids for r in result.records] == [r.token_ids for r in baseline.records]
    # Each turn computes its user tokens and the history's last block (which holds the answer's
    # last token, whose KV was never computed: it was sampled last); the rest of the history comes
    # from the prefix cache's tiers.
    first_turns = CONVERSATIONS * USER_TOKENS
    later_turns = CONVERSATIONS * (TURNS - 1) * (USER_TOKENS + BS)
    assert stats.prompt_tokens_computed <= first_turns + later_turns
    assert stats_off.prompt_tokens_computed > 1.5 * stats.prompt_tokens_computed  # recomputed histories
    assert stats.kv_offloaded_blocks > 0 and stats.kv_loaded_blocks > 0
    assert stats.cpu_prefix_cache_hit_tokens > 0
    assert stats.cpu_prefix_cache_hit_tokens == sum(r.cpu_cached_prompt_tokens for r in result.records)
    assert stats.num_preemptions > 0, "swap pre-emption meant to share the host pool with the tier"
    (executor,) = listed.values()
    assert executor.cpu_tier_blocks > 0 and executor.kv_loaded_bytes > 0
    # The last turn of a conversation against Hugging Face on the whole conversation.
    for c in (0, CONVERSATIONS - 1):
        history: list[int] = []
        for t in range(TURNS):
            index = c * TURNS + t
            history += list(requests[index].prompt)
            if t < TURNS - 1:
                history += result.records[index].token_ids
        assert result.records[c * TURNS + TURNS - 1].token_ids == hf_greedy(hf_model, history, ANSWER_TOKENS)


def test_an_executor_killed_while_offloading_loses_no_token(tiny_model_dir, tmp_path, without_tier):
    with running_services(tiny_model_dir, tmp_path, (*EXECUTOR, *TIER), SCHEDULER) as services:

        def kill_once_offloading() -> None:
            deadline = time.monotonic() + 60
            while scheduler_stats(services).kv_offloaded_blocks == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            services.restart_executor()  # SIGKILL mid-run, then a fresh executor on the same port

        killer = threading.Thread(target=kill_once_offloading)
        killer.start()
        _, result, stats = _run(services)
        killer.join()
    _, baseline, _ = without_tier
    assert [r.token_ids for r in result.records] == [r.token_ids for r in baseline.records]
    assert stats.gpu_blocks_in_use == 0 and stats.num_active_requests == 0


def test_a_disk_tier_below_a_small_cpu_tier_serves_the_histories_the_cpu_tier_drops(
    tiny_model_dir, tmp_path, without_tier
):
    """A CPU tier of a few histories' blocks over a disk tier for all of them: the histories the CPU
    tier drops are spilled to disk and fetched back, and the tokens stay those of the run without."""
    disk = tmp_path / "disk"
    disk.mkdir()
    small = ("--kv-offloading-size=0.0002", f"--kv-offloading-disk={disk}", "--kv-offloading-disk-size=0.002")
    with running_services(tiny_model_dir, tmp_path, (*EXECUTOR, *small), SCHEDULER) as services:
        _, result, stats = _run(services)
        (executor,) = _executors(services)
    _, baseline, stats_off = without_tier
    assert [r.token_ids for r in result.records] == [r.token_ids for r in baseline.records]
    assert stats.kv_spilled_blocks > 0 and stats.kv_fetched_blocks > 0
    assert executor.disk_tier_blocks > 0
    assert executor.kv_fetched_bytes == stats.kv_fetched_blocks * executor.kv_bytes_per_token * BS
    # As with a CPU tier for every history: each is computed once.
    assert stats.prompt_tokens_computed <= CONVERSATIONS * (USER_TOKENS + (TURNS - 1) * (USER_TOKENS + BS))
    assert list(disk.iterdir()) == []


def _executors(services):
    from pagedserve.protos import admin_pb2, admin_pb2_grpc

    with services.channel() as channel:
        reply = admin_pb2_grpc.AdminStub(channel).ListExecutors(admin_pb2.ListExecutorsRequest(), timeout=10)
    return list(reply.executors)
