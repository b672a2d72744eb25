"""Sizing the device KV pool on CUDA: measure what everything but the pool needs, give it the rest.

The pool takes all memory left under `gpu_memory_utilization` after
* the profiled peak of the worst eager step the config allows (weights + activations),
* memory this process took outside torch's allocator since it started (cuBLAS workspaces, loaded
  kernels), and
* a reserve for the CUDA graphs, which are captured *after* the pool exists (their kernels must
  see the real pool's addresses) and keep their own memory pool that eager steps cannot reuse.

The graph reserve is measured, not guessed: the larger of a decode pass at the largest decode graph
and a pass of the worst step (the largest mixed graph), each writing into a logits buffer as the
graphs do, is profiled the same way (graphs captured largest first into one shared pool need about
that much), plus a fixed allowance per graph for what the driver keeps for each instantiated
graph. After capture the runner logs the memory the graphs actually took.

Memory already in use on the device when the executor started (`in_use_at_start`: other processes,
e.g. executors sharing the GPU under `pagedserve serve --data-parallel-size`, and this process's
own CUDA context) is outside the budget, as in vLLM: `gpu_memory_utilization` is this executor's
share of the device, so two executors at 0.45 each fit on one GPU. Before, another process's memory
counted as this one's "outside torch", and the second executor on a GPU got no pool at all.
"""

from __future__ import annotations

import structlog
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.cuda_graphs import decode_graph_sizes, mixed_graph_sizes
from pagedserve.executor.kv_cache import KVCache, KVCacheLayout, MemoryProfile
from pagedserve.executor.model import CausalLM
from pagedserve.executor.sampler import SamplingParams, sample
from pagedserve.executor.step_inputs import build_step_inputs

log = structlog.get_logger(__name__)

# Bytes each buffer of the copy-bandwidth measurement holds: five times the H200's 50 MB of L2, so
# the copy runs from and to HBM, and small beside any device's free memory before the KV pool.
COPY_PROBE_BYTES = 256 << 20
_COPY_WARM_UP = 40  # ~6 ms of copies on an H200


def measure_copy_bandwidth(device: torch.device, nbytes: int = COPY_PROBE_BYTES, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy of `nbytes`, counting read + write (the convention of
    shared/bench/WORKLOADS.md: the H200 moved 4.28 TB/s), the best of `repeats` after ~40 copies
    of warm-up; 0.0 off CUDA.

    What a memory-bound step can reach at best: its read floor is the bytes it must read over this.
    Measured by the executor at start (before the KV pool exists) and by the benchmarks in the
    same run as what they compare with it. (The median of 10 copies without the warm-up, on an idle
    GPU, read up to 5% low in one start of five on one H100: a floor 5% too high.)
    """
    if device.type != "cuda":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(_COPY_WARM_UP):  # first touch, and the clocks up
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / min(seconds)


# Bytes of the host-link measurement: 32 blocks of a llama-8b-shape pool, a few ms on PCIe 5.
HOST_PROBE_BYTES = 64 << 20


def measure_host_copy_bandwidth(
    device: torch.device, nbytes: int = HOST_PROBE_BYTES, repeats: int = 5
) -> float:
    """Bytes/s of a pinned host-to-device copy of `nbytes` (the CPU tier's loads), the median of
    `repeats`; 0.0 off CUDA. The scheduler sizes the tier's loads per plan by it
    (scheduler.kv_tier.load_budget)."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # first touch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    seconds.sort()
    return nbytes / seconds[len(seconds) // 2]


# Per graph, for what the decode-pass measurement misses: the driver's instantiated graph, the
# capture stream's cuBLAS workspace, allocator rounding in the private pool. Measured on an H200
# (27 graphs, max_num_seqs 256): the decode pass alone reserved 184 MiB while capture took 369 MiB
# (llama-8b-shape, 32 layers) and 508 MiB (4 layers); with the mixed graphs too (59 graphs) the
# passes measured 1.16 GiB and capture took 2.23 GiB, so 24 MiB a graph covers both.
# The runner warns (executor.graph_reserve_exceeded) if capture ever takes more than reserved.
GRAPH_OVERHEAD_BYTES = 24 << 20


# Eager steps the start-up also runs, after the worst step, so that the Triton kernels of the eager
# path compile there and not in a request: Triton compiles a kernel once per class of each integer
# argument (1, a multiple of 16, any other value), the worst step and the CUDA graphs' padded
# sizes cover multiples of 16 only, and the first step of a server with an FP8 KV cache (the scale
# calibration) or with prompt logprobs runs eagerly at whatever size it gets. Compiled in the first
# request, they cost it ~1 s on an H100 (W1 with FP8 KV lost 1.0-1.7 s in its first step and read
# 11,524 output tok/s on an H200 instead of ~15,000): one prompt and two, of odd lengths.
WARM_UP_LENS = ([13], [13, 6])


def _scratch_pool(layout: KVCacheLayout, lens: list[int], device: torch.device):
    tables, next_block = [], 0
    for n in lens:
        tables.append(list(range(next_block, next_block + layout.blocks_for(n))))
        next_block += layout.blocks_for(n)
    return KVCache(layout, next_block, 0, device), tables


def worst_step_lens(config: ExecutorConfig, max_model_len: int) -> list[int]:
    """The largest step the config allows: max_num_batched_tokens tokens over up to max_num_seqs
    prefills."""
    num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens))
    per_seq = min(max_model_len, -(-config.max_num_batched_tokens // num_seqs))
    return [per_seq] * num_seqs


def num_cuda_graphs(config: ExecutorConfig, max_model_len: int) -> int:
    """How many graphs the runner captures (decode batch sizes and mixed token counts)."""
    return len(decode_graph_sizes(config.max_num_seqs)) + len(
        mixed_graph_sizes(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
    )


def _eager_step_peak(model: CausalLM, layout: KVCacheLayout, lens: list[int], calibrate: bool = False) -> int:
    """Peak torch memory (pool excluded) of an eager step of `lens` prefills, all sampled with
    top-k/top-p (the sampler's sort is the largest temporary).

    `calibrate`: the step sets the FP8 KV scales as the first real step will, then puts them back,
    so that the calibration's kernels compile here (see `WARM_UP_LENS`)."""
    device = next(model.parameters()).device
    num_seqs = len(lens)
    torch.cuda.reset_peak_memory_stats(device)
    scratch, tables = _scratch_pool(layout, lens, device)
    scratch_bytes = scratch.device_pool.numel() * scratch.device_pool.element_size()
    inputs = build_step_inputs([[0] * n for n in lens], [0] * num_seqs, tables, [True] * num_seqs,
                               layout.block_size, device, model.kv_groups.num_groups)  # fmt: skip
    caches = scratch.layer_caches(model.kv_groups.layer_slot)
    model.set_kv_calibration(calibrate)
    try:
        logits = model(inputs.input_ids, inputs.meta, caches, inputs.logits_indices)
    finally:
        model.set_kv_calibration(False)
        if calibrate:
            model.reset_kv_scales()
    if logits is not None:  # None on a tensor-parallel worker: rank 0 alone samples
        sample(logits, [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * num_seqs, lens)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - scratch_bytes


def _graph_pass_bytes(model: CausalLM, layout: KVCacheLayout, lens: list[int]) -> int:
    """Torch memory a forward pass of `lens` new tokens per sequence (logits for every sequence,
    written into a buffer as a graph does) allocates beyond what is live before it."""
    device = next(model.parameters()).device
    num_seqs = len(lens)
    scratch, tables = _scratch_pool(layout, lens, device)
    inputs = build_step_inputs([[0] * n for n in lens], [0] * num_seqs, tables, [True] * num_seqs,
                               layout.block_size, device, model.kv_groups.num_groups)  # fmt: skip
    decode = all(n == 1 for n in lens)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = torch.empty((num_seqs, model.spec.vocab_size), dtype=torch.float32, device=device)
    indices = None if decode else inputs.logits_indices
    model(inputs.input_ids, inputs.meta, scratch.layer_caches(model.kv_groups.layer_slot), indices, out=out)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def memory_in_use(device: torch.device) -> tuple[int, int]:
    """(bytes in use on the device, its total), from the driver: every process's memory, this
    one's CUDA context included (the call creates it)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total


@torch.inference_mode()
def profile_cuda(
    model: CausalLM,
    layout: KVCacheLayout,
    config: ExecutorConfig,
    max_model_len: int,
    cuda_graphs: bool,
    in_use_at_start: int = 0,
) -> MemoryProfile:
    """Measures the memory everything but the KV pool needs (see the module docstring).

    Args:
        in_use_at_start: device memory in use before this executor loaded anything (see
            `memory_in_use`); it is not counted as this executor's.
    """
    device = next(model.parameters()).device
    torch.cuda.empty_cache()
    lens = worst_step_lens(config, max_model_len)
    calibrate = model.needs_kv_calibration(config.kv_cache_dtype)
    peak = _eager_step_peak(model, layout, lens, calibrate)
    for odd in WARM_UP_LENS:
        _eager_step_peak(model, layout, [min(n, max_model_len) for n in odd], calibrate)
    graph_reserve = 0
    if cuda_graphs:
        num_graphs = num_cuda_graphs(config, max_model_len)
        decode_pass = _graph_pass_bytes(model, layout, [1] * config.max_num_seqs)
        graph_reserve = max(decode_pass, _graph_pass_bytes(model, layout, lens))
        graph_reserve += GRAPH_OVERHEAD_BYTES * num_graphs
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device) - in_use_at_start)
    log.info(
        "executor.profiled",
        tokens=sum(lens),
        seqs=len(lens),
        peak_gib=round(peak / 2**30, 3),
        non_torch_gib=round(non_torch / 2**30, 3),
        graph_reserve_gib=round(graph_reserve / 2**30, 3),
    )
    return MemoryProfile(peak, non_torch, total, graph_reserve)
