"""The prefix cache's disk tier below the CPU tier (--kv-offloading-disk, scheduler.kv_cache_manager,
executor.disk_tier): which blocks the scheduler spills and fetches (exact slots), a block read back
from disk bit for bit through the executor's own runner, and the flags' refusals. End to end
through real services: tests/test_kv_tier_e2e.py."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.disk_tier import DiskTierError, DiskTierFile
from pagedserve.executor.runner import ModelRunner
from pagedserve.protos import executor_pb2
from pagedserve.scheduler.kv_cache_manager import CpuBlock, DiskBlock, KVCacheManager
from pagedserve.scheduler.request import Request, SamplingOptions, SeqId

BS = 4


def _request(seq_id: int, first_token: int, num_tokens: int) -> Request:
    return Request(SeqId(seq_id), list(range(first_token, first_token + num_tokens)), 4, SamplingOptions())


def _manager(num_gpu_blocks: int, num_cpu_blocks: int, num_disk_blocks: int) -> KVCacheManager:
    """A manager whose host pool is all CPU tier, with a disk tier below it."""
    return KVCacheManager(
        BS, num_gpu_blocks, num_cpu_blocks, num_cpu_offload_blocks=num_cpu_blocks,
        num_disk_offload_blocks=num_disk_blocks,
    )  # fmt: skip


def _step(kv: KVCacheManager, request: Request, *, ahead: bool = False) -> tuple:
    """One plan that admits `request` on its hit, computes it and frees it (its full blocks stay
    cached); returns the plan's (offloads, loads) and (spills, fetches, spills ahead). The spills
    ahead are planned only if `ahead` (as the scheduler does at the end of every plan)."""
    hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens, hit) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    kv.free(request)
    if ahead:
        kv.spill_ahead()
    moves = kv.take_tier_moves(), kv.take_disk_moves()
    kv.end_step()
    return moves


def test_the_cpu_tier_spills_what_it_drops_and_a_disk_hit_is_fetched_then_loaded_by_the_next_plan():
    kv = KVCacheManager(
        BS, num_gpu_blocks=4, num_cpu_blocks=2, num_cpu_offload_blocks=2, num_disk_offload_blocks=4
    )
    _step(kv, _request(1, 100, 5))  # one full block cached on the GPU
    assert _step(kv, _request(2, 200, 16)) == (([(0, 0)], []), ([], [], []))  # evicted into the CPU tier
    # The next 4 blocks evict 2 of the pool's cached blocks: the tier (full) drops its oldest, the
    # first prompt's, which is written to disk slot 0 before host block 0 takes the new one.
    (offloads, _), (spills, fetches, _) = _step(kv, _request(3, 300, 16))
    assert offloads == [(0, 1), (3, 0)] and spills == [(0, 0)] and fetches == []
    # The first prompt again: only the disk tier has its block.
    again = _request(4, 100, 5)
    hit = kv.get_computed_blocks(again)
    assert hit.tables == ((DiskBlock(0),),) and hit.num_disk_blocks == 1 and hit.num_cpu_blocks == 1
    (offloads, loads), (spills, fetches, _) = _step(kv, again)
    # Host block 1 is made room for (its block spilled to a fresh disk slot, not the one read) and
    # the block fetched into it; the next plan loads it into the request's first GPU block.
    assert fetches == [(0, 1)] and (1, 1) in spills and all(slot != 0 for _, slot in spills)
    assert loads == [] and (kv.num_spilled_blocks, kv.num_fetched_blocks) == (1 + len(spills), 1)
    # The block is in the GPU prefix cache at once (held until its load is planned): a request
    # admitted now shares it, and waits for the load too.
    twin = kv.get_computed_blocks(_request(5, 100, 5))
    assert twin.num_tokens == 4 and twin.num_cpu_blocks == 0 and kv.waits_for_loads(twin)
    (block,) = twin.blocks
    assert kv.held_for_loads == [block] and block.ref_count == 1
    assert kv.take_tier_moves() == ([], [(1, block.block_id)])
    kv.end_step()
    assert kv.held_for_loads == [] and block.ref_count == 0


def test_blocks_spilled_ahead_leave_the_next_plans_evictions_nothing_to_write():
    """Once a plan's insertions leave the CPU tier too little room for as many more, as many of its
    oldest blocks (none the plan moves) are written to disk beside the step; the next plan's
    insertion evicts one of those and spills nothing before reusing its host block."""
    kv = _manager(2, 2, 4)
    _step(kv, _request(1, 100, 5), ahead=True)  # one full block cached on the GPU
    assert _step(kv, _request(2, 200, 5), ahead=True)[1] == ([], [], [])  # into the tier: room left
    _, (spills, _, ahead) = _step(kv, _request(3, 300, 5), ahead=True)  # the tier is full now
    assert spills == [] and ahead == [(0, 0)], "the oldest block, the first prompt's, to disk slot 0"
    (offloads, _), (spills, _, _) = _step(kv, _request(4, 400, 5))  # evicts the first prompt's
    assert offloads == [(0, 0)] and spills == [], "its block was on disk already"
    assert kv.get_computed_blocks(_request(5, 100, 5)).tables == ((DiskBlock(0),),)


def test_a_full_disk_tier_overwrites_its_least_recently_used_slot():
    kv = KVCacheManager(
        BS, num_gpu_blocks=2, num_cpu_blocks=1, num_cpu_offload_blocks=1, num_disk_offload_blocks=1
    )
    for seq_id in range(1, 5):  # each evicts the one before, the tier spilling the one before that
        _step(kv, _request(seq_id, 100 * seq_id, 5))
    assert kv.num_spilled_blocks == 2 and len(kv.disk_tier) == 1
    assert kv.get_computed_blocks(_request(9, 100, 5)).num_tokens == 0, "overwritten on disk"
    hit = kv.get_computed_blocks(_request(10, 200, 5))
    assert hit.tables == ((DiskBlock(0),),)


def test_a_disk_hit_the_cpu_tier_cannot_stage_is_computed_instead():
    """The CPU tier's one host block holds the hit's first block (kept: the plan loads it), so the
    disk block after it has nowhere to be fetched to: the hit ends before it."""
    kv = KVCacheManager(
        BS, num_gpu_blocks=3, num_cpu_blocks=1, num_cpu_offload_blocks=1, num_disk_offload_blocks=4
    )
    _step(kv, _request(1, 100, 9))  # two full blocks cached, the second (its tail) evicted first
    _step(kv, _request(2, 200, 5))  # evicts the second into the tier
    _step(kv, _request(3, 300, 5))  # evicts the first into the tier, which spills the second
    hit = kv.get_computed_blocks(_request(4, 100, 9))
    assert hit.tables == ((CpuBlock(0),),) and hit.num_tokens == BS
    _step(kv, _request(4, 100, 9))
    assert kv.num_fetched_blocks == 0


@pytest.fixture(scope="module")
def disk_runner(tiny_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("disk-tier")
    runner = ModelRunner.create(
        ExecutorConfig(
            model=str(tiny_model_dir),
            device="cpu",
            num_gpu_blocks_override=16,
            swap_space=0.0,
            kv_offloading_size=0.001,
            kv_offloading_disk=str(directory),
            kv_offloading_disk_size=0.001,
            max_model_len=128,
        )  # fmt: skip
    )
    return runner, directory


def disk_round_trip(runner: ModelRunner) -> None:
    """A prompt's KV offloaded to host blocks, spilled to disk (one before the plan's moves, one
    beside its step), the host blocks overwritten, fetched back into other host blocks (beside a
    step) and loaded by the next plan into other GPU blocks is bit for bit what was computed (on
    CUDA the tier's copies run on their copy stream: test_executor_cuda)."""
    assert runner.kv_cache.num_disk_blocks > 4
    runner.reset()
    prompt = list(range(5, 37))  # two full blocks of 16
    table = executor_pb2.BlockTable(block_ids=[3, 4, 5])
    first = executor_pb2.NewRequest(seq_id=1, token_ids=prompt, num_new_tokens=32, block_tables=[table])
    runner.execute(executor_pb2.StepPlan(new_requests=[first]))
    kv = runner.kv_cache
    computed = kv.device_pool[:, :, [3, 4]].clone()

    def moves(*pairs: tuple[int, int]) -> list[executor_pb2.BlockMove]:
        return [executor_pb2.BlockMove(src=src, dst=dst) for src, dst in pairs]

    runner.execute(executor_pb2.StepPlan(removed_seq_ids=[1], offload=moves((3, 0), (4, 1))))
    runner.execute(executor_pb2.StepPlan(spill=moves((0, 3)), spill_ahead=moves((1, 2))))  # -> slots 3, 2
    runner.execute(executor_pb2.StepPlan())  # (the next plan waits for the spill ahead)
    kv.cpu_pool[[0, 1, 2, 3]] = torch.full_like(kv.cpu_pool[[0, 1, 2, 3]], float("nan"))
    kv.device_pool[:, :, [3, 4]] = float("nan")
    runner.execute(executor_pb2.StepPlan(fetch=moves((3, 2), (2, 3))))  # read while the step runs
    runner.execute(executor_pb2.StepPlan(load=moves((2, 9), (3, 11))))  # the next plan loads them
    runner.execute(executor_pb2.StepPlan())  # (the step after: it waits for the copies)
    loaded = kv.device_pool[:, :, [9, 11]]
    assert torch.equal(loaded.view(torch.uint8), computed.view(torch.uint8))


def test_a_block_fetched_from_disk_is_the_block_that_was_offloaded(disk_runner):
    runner, directory = disk_runner
    disk_round_trip(runner)
    assert os.listdir(directory) == [], "the disk tier's file is unlinked: nothing is left behind"


def test_a_plan_out_of_the_disk_tiers_slots_is_refused(disk_runner):
    runner, _ = disk_runner
    slot = runner.kv_cache.num_disk_blocks
    with pytest.raises(ValueError, match="spill"):
        runner.execute(executor_pb2.StepPlan(spill=[executor_pb2.BlockMove(src=0, dst=slot)]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"kv_offloading_disk_size": 1.0}, "kv_offloading_disk_size needs kv_offloading_disk"),
        ({"kv_offloading_disk": "."}, "kv_offloading_disk needs kv_offloading_disk_size"),
        ({"kv_offloading_disk": ".", "kv_offloading_disk_size": 1.0}, "needs the CPU tier above it"),
        ({"kv_offloading_disk": "/no/such/dir", "kv_offloading_disk_size": 1.0, "kv_offloading_size": 1.0},
         "must be an existing directory"),
        ({"kv_offloading_disk": ".", "kv_offloading_disk_size": -1.0}, "disk_size must be >= 0"),
    ],
)  # fmt: skip
def test_the_disk_tiers_flags_are_refused_apart_or_without_a_cpu_tier(flags, message):
    with pytest.raises(ValueError, match=message):
        ExecutorConfig(model="m", **flags)


def test_a_disk_tier_larger_than_the_free_space_is_refused_at_start(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(DiskTierError, match="does not fit"):
        DiskTierFile(tmp_path, num_blocks=2, bytes_per_block=free)
    disk = DiskTierFile(tmp_path, num_blocks=2, bytes_per_block=8)
    block = torch.arange(2, dtype=torch.float32)
    disk.write(1, block)
    back = torch.zeros(2)
    disk.read_into(1, back)
    assert torch.equal(back, block) and os.listdir(tmp_path) == []
    with pytest.raises(IndexError):
        disk.write(2, block)
    disk.close()
