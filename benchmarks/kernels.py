"""Benchmark of the Triton paged-attention kernels against SDPA on contiguous tensors (run on a GPU).

    python -m benchmarks.kernels [--result-file bench-results/kernels.json] [--sweep]

1. Correctness: workload K1's decode shapes, mixed prefill/decode batches and the prefill case, each
   against `kernels.reference` in fp32 (max abs error printed, checked against a tolerance).
2. Timing, median of `triton.testing.do_bench` (which flushes L2 before every repetition), for ours
   and for the anchor alike, three ways:
   * eager: the Python call (host launch cost included when the GPU waits for it);
   * graph: a CUDA-graph replay of one call. A replay of a ~8 us kernel is bound by how fast the
     host can replay graphs, so this overstates small kernels;
   * graph x20: one CUDA graph holding 20 calls back to back, time per call = total / 20. This is
     what the executor runs (a decode step's graph holds one attention call per layer, 32 in a
     row), so the decode goals are judged on it. Like the layers of a model, the 20 calls read
     different KV: they cycle through enough input sets (block tables over the pool for ours,
     contiguous copies for SDPA) that a call never finds its KV in L2 from an earlier call.
   * K1 decode: bf16, 32 query / 8 KV heads, head_dim 128, block_size 16, random block tables over
     a pool much larger than the working set; the anchor is
     `scaled_dot_product_attention(..., enable_gqa=True)` on a contiguous cache of the same shape.
     Bandwidth counts the KV bytes read, B * L * 2 * 8 * 128 * 2.
   * Gather floor (decode shapes, graph x20): a kernel that only reads the same paged K and V
     through the same block tables and sums them (no softmax, no split merge, no output). It is
     what any kernel of this design needs at least, so sdpa / floor bounds the reachable ratio.
     The contiguous floor does the same reads from the anchor's contiguous K and V (no block table):
     sdpa / contiguous floor bounds what any decode kernel, paged or not, could reach.
   * Prefill: 8 sequences x 2048 tokens, causal, 32/8 heads, head_dim 128, bf16, against SDPA's
     causal attention on contiguous tensors; TFLOP/s counts 4 * S * H * T^2 * D / 2.
   * Sliding window (Mistral, Gemma's local layers): K1's (64, 4096) decode with a window of 1,024
     keys against the same call without a window and against (64, 1024) (graph x20: a windowed
     decode reads 1,024 keys per sequence, so it should take about the (64, 1024) time, ~4x less
     than without); the prefill case with the same window against none (the window leaves 3/4 of
     the causal score pairs).
3. `--sweep` also times, from 20-call graphs, every decode shape with other decode configs (keys
   per tile, warps, pipeline stages) x split counts, and the prefill case with other tile configs,
   and ends with the best setting per shape next to the default's time (see `print_sweep_summary`).
   The whole run stays within `--sweep-budget-s` seconds (settings left out are reported). It also
   times the default and the tall prefill tiles on a few batch compositions, next to the tile
   `choose_prefill_config` picks for each (`PREFILL_TILE_CASES`).

A line per case shows progress; a short table comes last; the JSON holds everything.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from pagedserve.kernels import reference
from pagedserve.kernels import triton_attention as ta

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
K1_SHAPES = [(1, 4096), (8, 4096), (64, 1024), (64, 4096), (256, 1024), (32, 16384)]
PREFILL_SEQS, PREFILL_LEN = 8, 2048
# Decode goals: ratio of our KV bandwidth to the anchor's.
DECODE_GOALS = {(1, 4096): 2.0, (8, 4096): 1.2, (64, 4096): 0.9, (256, 1024): 0.9, (32, 16384): 0.9}
PREFILL_GOAL = 0.6
BF16_TOLERANCE = 2e-2

GRAPH_CALLS = 20
# Decode configs (keys per tile, warps, stages) x split counts for --sweep. A split count whose
# partition is exactly one tile runs the single-tile variant (see kernels/triton_attention.py).
DECODE_SWEEP = [
    ta.DecodeConfig(64, 4, 3),
    ta.DecodeConfig(64, 4, 2),
    ta.DecodeConfig(32, 4, 3),
    ta.DecodeConfig(64, 8, 3),
    ta.DecodeConfig(128, 4, 3),
    ta.DecodeConfig(128, 8, 2),
    ta.DecodeConfig(128, 8, 3),
    ta.DecodeConfig(256, 8, 2),
]
SMALL_BATCH_SPLITS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
LARGE_BATCH_SPLITS = (1, 2, 3, 4)
# --sweep: batch compositions (new tokens, context lengths) on which the default and the tall
# prefill tiles are compared, next to the one `choose_prefill_config` picks for each.
W1_CHUNK = [992, 522, 904, 558, 169, 393, 651, 625, 542, 930, 977, 438]  # 12 W1-like prompts
PREFILL_TILE_CASES = {
    "1 prompt of 512": ([512], [512]),
    "1 prompt of 2048": ([2048], [2048]),
    "1 prompt of 4096": ([4096], [4096]),
    "4 chunks of 512 after 3072": ([512] * 4, [3584] * 4),
    "12 prompts, 7701 tokens": (W1_CHUNK, W1_CHUNK),
    "8 prompts of 2048": ([2048] * 8, [2048] * 8),
    "256 decodes of 512 + a 2048 prompt": ([1] * 256 + [2048], [512] * 256 + [2048]),
}
PREFILL_SWEEP = [
    ta.PrefillConfig(64, 64, 4, 3),
    ta.PrefillConfig(64, 64, 4, 2),
    ta.PrefillConfig(64, 32, 4, 3),
    ta.PrefillConfig(64, 32, 4, 4),
    ta.PrefillConfig(64, 128, 4, 2),
    ta.PrefillConfig(128, 64, 8, 2),
    ta.PrefillConfig(128, 64, 8, 3),
    ta.PrefillConfig(128, 128, 8, 2),
    ta.PrefillConfig(128, 128, 8, 3),
    ta.PrefillConfig(128, 32, 8, 3),
    ta.PrefillConfig(128, 64, 4, 2),
    ta.PrefillConfig(32, 64, 4, 3),
    ta.PrefillConfig(256, 64, 16, 2),
    ta.PrefillConfig(256, 64, 16, 3),
    ta.PrefillConfig(256, 32, 16, 2),
]


# The floor kernels' tile and programs: 64 keys x 4 warps (8 for the contiguous one), enough splits
# for 4 programs per SM. On an H200 a sweep of tile size, warps and programs per SM (1, 4096 and
# 8, 4096) found nothing more than 3% faster than these.
FLOOR_BLOCK_N, FLOOR_WARPS, FLOOR_PROGRAMS_PER_SM = 64, 4, 4
CONTIGUOUS_FLOOR_WARPS = 8


def whole_tile_splits(batch: int, context: int, block_n: int, programs_per_sm: int, sm_count: int) -> int:
    """Splits of each (sequence, KV head) for the floor and experiment kernels: enough programs for
    `programs_per_sm` on every SM, whole tiles of `block_n` keys each."""
    tiles = context // block_n
    splits = max(1, min(tiles, math.ceil(programs_per_sm * sm_count / (batch * NUM_KV_HEADS))))
    while tiles % splits:
        splits -= 1
    return splits


@triton.jit
def gather_only_kernel(
    k_ptr,
    v_ptr,
    block_tables_ptr,
    out_ptr,
    keys_per_program,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bt,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Reads one (sequence, KV head, split)'s keys and values through its block table and stores
    their sum: a decode call's memory traffic with none of its math (the floor in `time_decode`)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, HEAD_DIM)
    total = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    first = split * keys_per_program
    for k0 in range(first, first + keys_per_program, BLOCK_N):
        kpos = k0 + tl.arange(0, BLOCK_N)
        block_ids = tl.load(block_tables_ptr + seq * stride_bt + kpos // PAGE_SIZE).to(tl.int64)
        rows = block_ids * stride_kb + (kpos % PAGE_SIZE) * stride_kt + kv_head * stride_kh
        total += tl.load(k_ptr + rows[:, None] + d[None, :]).to(tl.float32)
        total += tl.load(v_ptr + rows[:, None] + d[None, :]).to(tl.float32)
    program = (seq * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split
    tl.store(out_ptr + program, tl.sum(tl.sum(total, 1), 0))


@triton.jit
def contiguous_read_kernel(
    k_ptr, v_ptr, out_ptr, keys_per_program, length, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """`gather_only_kernel` on the anchor's contiguous [B, KV heads, L, D] K and V: no block table,
    so no dependent load before the first K/V bytes. What even a kernel without paging needs."""
    row = tl.program_id(0)  # (sequence, KV head)
    split = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    total = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    base = row.to(tl.int64) * length * HEAD_DIM
    first = split * keys_per_program
    for k0 in range(first, first + keys_per_program, BLOCK_N):
        rows = base + (k0 + tl.arange(0, BLOCK_N)).to(tl.int64) * HEAD_DIM
        total += tl.load(k_ptr + rows[:, None] + d[None, :]).to(tl.float32)
        total += tl.load(v_ptr + rows[:, None] + d[None, :]).to(tl.float32)
    tl.store(out_ptr + row * tl.num_programs(1) + split, tl.sum(tl.sum(total, 1), 0))


def log(msg: str) -> None:
    print(msg, flush=True)


def bench(fn: Callable[[], object], quick: bool = False) -> float:
    """Median time in µs; do_bench clears L2 before each repetition."""
    warmup, rep = (5, 25) if quick else (25, 100)
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


class Pool:
    """One paged KV pool shared by all decode cases; block tables draw random blocks from it."""

    def __init__(self, num_blocks: int, device: torch.device) -> None:
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k = torch.randn(shape, dtype=DTYPE, device=device)
        self.v = torch.randn(shape, dtype=DTYPE, device=device)
        self.num_blocks = num_blocks

    def block_tables(self, batch: int, blocks_per_seq: int) -> torch.Tensor:
        ids = torch.randperm(self.num_blocks, device=self.k.device)[: batch * blocks_per_seq]
        return ids.view(batch, blocks_per_seq).to(torch.int32)


def contiguous_kv(pool: Pool, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged context gathered into [B, kv_heads, L, D] (the anchor's layout)."""
    ids = block_tables.long()
    k = pool.k[ids].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
    v = pool.v[ids].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
    return k, v


def max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return (out.float() - expected.float()).abs().max().item()


def decode_inputs(pool: Pool, batch: int, length: int) -> dict:
    device = pool.k.device
    return dict(
        q=torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device),
        k_cache=pool.k,
        v_cache=pool.v,
        block_tables=pool.block_tables(batch, length // BLOCK_SIZE),
        seq_lens=torch.full((batch,), length, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
        scale=HEAD_DIM**-0.5,
    )


def check_correctness(pool: Pool, results: dict) -> bool:
    """K1 shapes and mixed batches against the fp32 reference."""
    ok = True
    checks = results.setdefault("correctness", [])
    for batch, length in K1_SHAPES:
        inputs = decode_inputs(pool, batch, length)
        out = ta.paged_attention(**inputs)
        ref = reference.paged_attention(**{**inputs, "q": inputs["q"].float()})
        err = max_error(out, ref)
        passed = err < BF16_TOLERANCE and not out.isnan().any().item()
        ok &= passed
        checks.append({"case": f"decode B={batch} L={length}", "max_abs_err": err, "ok": passed})
        log(f"check decode B={batch:<4} L={length:<6} max|err|={err:.2e} {'ok' if passed else 'FAIL'}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    mixes = [
        ([1] * 16 + [512, 37, 2048], [900] * 16 + [1024, 3000, 2048]),
        ([1, 300, 1, 0, 77], [5000, 300, 64, 10, 1000]),
    ]
    for q_lens, ctx in mixes:
        inputs = mixed_inputs(pool, q_lens, ctx, gen)
        out = ta.paged_attention(**inputs)
        ref = reference.paged_attention(**{**inputs, "q": inputs["q"].float()})
        err = max_error(out, ref)
        passed = err < BF16_TOLERANCE and not out.isnan().any().item()
        ok &= passed
        checks.append({"case": f"mixed q_lens={q_lens[-5:]}", "max_abs_err": err, "ok": passed})
        log(
            f"check mixed ({len(q_lens)} seqs, {sum(q_lens)} tokens) "
            f"max|err|={err:.2e} {'ok' if passed else 'FAIL'}"
        )
    return ok


def mixed_inputs(pool: Pool, q_lens: list[int], ctx: list[int], gen: torch.Generator) -> dict:
    device = pool.k.device
    width = max(math.ceil(c / BLOCK_SIZE) for c in ctx)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return dict(
        q=torch.randn(int(cu[-1]), NUM_Q_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(device),
        k_cache=pool.k,
        v_cache=pool.v,
        block_tables=pool.block_tables(len(q_lens), width),
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        scale=HEAD_DIM**-0.5,
    )


def as_graph(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured in a CUDA graph (after a warm-up call); returns its replay.

    The executor replays decode steps from graphs; this takes the host's launch cost (Python wrapper,
    Triton's launcher) out of the measurement, but not the cost of replaying a graph.
    """
    return as_graph_calls([fn])


def as_graph_calls(fns: list[Callable[[], object]]) -> Callable[[], None]:
    """All fns captured back to back in one CUDA graph (after a warm-up round); returns its replay."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    return graph.replay


def per_call_us(fns: list[Callable[[], object]], quick: bool = False) -> float:
    """Time per call of GRAPH_CALLS calls in one graph, cycling through fns (one per input set)."""
    calls = [fns[i % len(fns)] for i in range(GRAPH_CALLS)]
    return bench(as_graph_calls(calls), quick) / GRAPH_CALLS


def input_sets(bytes_per_call: int, l2_bytes: int) -> int:
    """Input sets for the 20-call graphs: enough that the other sets' bytes read between two uses of
    one set are at least twice the L2, so no call finds its KV in L2 from an earlier call."""
    return max(2, min(GRAPH_CALLS, math.ceil(2 * l2_bytes / bytes_per_call) + 1))


def host_us_per_call(fn: Callable[[], object], calls: int = 200) -> float:
    """Host time per eager call (launch overhead), measured without synchronising in between."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


@dataclass
class DecodeCase:
    """One K1 decode shape: input sets for ours (block tables over the pool) and for SDPA (copies)."""

    batch: int
    length: int
    inputs: list[dict]
    outs: list[torch.Tensor]
    sdpa_args: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.length * 2 * NUM_KV_HEADS * HEAD_DIM * 2

    def ours(self, **overrides) -> list[Callable[[], object]]:
        return [
            functools.partial(ta.paged_attention, **inputs, out=out, **overrides)
            for inputs, out in zip(self.inputs, self.outs, strict=True)
        ]

    def floor_splits(self, sm_count: int) -> int:
        """Splits of each (sequence, KV head) for the floor kernels."""
        return whole_tile_splits(self.batch, self.length, FLOOR_BLOCK_N, FLOOR_PROGRAMS_PER_SM, sm_count)

    def gather_floor(self, sm_count: int) -> list[Callable[[], object]]:
        """`gather_only_kernel` over the same block tables (needs K1's whole-tile lengths)."""
        splits = self.floor_splits(sm_count)
        grid = (self.batch, NUM_KV_HEADS, splits)
        k, v = self.inputs[0]["k_cache"], self.inputs[0]["v_cache"]
        sums = torch.empty(math.prod(grid), dtype=torch.float32, device=k.device)
        return [
            functools.partial(
                gather_only_kernel[grid],
                k,
                v,
                i["block_tables"],
                sums,
                self.length // splits,
                *k.stride()[:3],
                i["block_tables"].stride(0),
                BLOCK_N=FLOOR_BLOCK_N,
                PAGE_SIZE=BLOCK_SIZE,
                HEAD_DIM=HEAD_DIM,
                num_warps=FLOOR_WARPS,
            )  # fmt: skip
            for i in self.inputs
        ]

    def contiguous_floor(self, sm_count: int) -> list[Callable[[], object]]:
        """`contiguous_read_kernel` over the anchor's K and V (the bytes SDPA reads)."""
        splits = self.floor_splits(sm_count)
        grid = (self.batch * NUM_KV_HEADS, splits)
        sums = torch.empty(math.prod(grid), dtype=torch.float32, device=self.sdpa_args[0][1].device)
        return [
            functools.partial(
                contiguous_read_kernel[grid],
                k,
                v,
                sums,
                self.length // splits,
                self.length,
                BLOCK_N=FLOOR_BLOCK_N,
                HEAD_DIM=HEAD_DIM,
                num_warps=CONTIGUOUS_FLOOR_WARPS,
            )  # fmt: skip
            for _, k, v in self.sdpa_args
        ]

    def sdpa(self) -> list[Callable[[], object]]:
        return [
            functools.partial(F.scaled_dot_product_attention, q4, k, v, enable_gqa=True)
            for q4, k, v in self.sdpa_args
        ]


def make_decode_case(pool: Pool, batch: int, length: int, l2_bytes: int) -> DecodeCase:
    sets = input_sets(batch * length * 2 * NUM_KV_HEADS * HEAD_DIM * 2, l2_bytes)
    inputs = [decode_inputs(pool, batch, length) for _ in range(sets)]
    outs = [torch.empty_like(i["q"]) for i in inputs]
    sdpa_args = [(i["q"].unsqueeze(2), *contiguous_kv(pool, i["block_tables"], length)) for i in inputs]
    return DecodeCase(batch, length, inputs, outs, sdpa_args)


def plan_summary(inputs: dict, config: ta.DecodeConfig | None = None, splits: int | None = None) -> dict:
    """The decode launch ours makes for these inputs: tile config, splits, single-tile or not."""
    plan = ta.decode_plan(inputs["q"], inputs["k_cache"], inputs["block_tables"], config, splits)
    meta = plan.meta
    return {
        "block_n": meta["BLOCK_N"],
        "num_warps": meta["num_warps"],
        "num_stages": meta["num_stages"],
        "num_splits": plan.num_splits,
        "tokens_per_split": plan.tokens_per_split,
        "single_tile": meta["SINGLE_TILE"],
    }


def describe(p: dict) -> str:
    tile = " single-tile" if p["single_tile"] else ""
    return (
        f"bn={p['block_n']} w={p['num_warps']} s={p['num_stages']} splits={p['num_splits']}"
        f" ({p['tokens_per_split']} keys/split{tile})"
    )


def time_decode(pool: Pool, results: dict, sweep: bool, deadline: float) -> None:
    """K1: eager, one-call graph and 20-call graph timings of ours and of the anchor.

    The sweep's time until `deadline` is shared evenly by the shapes not yet swept.
    """
    rows = results.setdefault("decode", [])
    l2_bytes = results["l2_bytes"]
    for index, (batch, length) in enumerate(K1_SHAPES):
        case = make_decode_case(pool, batch, length, l2_bytes)
        ours_fn, sdpa_fn = case.ours()[0], case.sdpa()[0]
        ours, anchor = bench(ours_fn), bench(sdpa_fn)
        ours_graph, anchor_graph = bench(as_graph(ours_fn)), bench(as_graph(sdpa_fn))
        ours_20, anchor_20 = per_call_us(case.ours()), per_call_us(case.sdpa())
        floor_20 = per_call_us(case.gather_floor(results["sm_count"]))
        contiguous_floor_20 = per_call_us(case.contiguous_floor(results["sm_count"]))
        kv_bytes = case.kv_bytes
        plan = plan_summary(case.inputs[0])
        row = {
            "batch": batch,
            "context": length,
            "triton_us": ours,
            "triton_tbps": kv_bytes / ours / 1e6,
            "sdpa_us": anchor,
            "sdpa_tbps": kv_bytes / anchor / 1e6,
            "speedup": anchor / ours,
            "triton_graph_us": ours_graph,
            "triton_graph_tbps": kv_bytes / ours_graph / 1e6,
            "sdpa_graph_us": anchor_graph,
            "sdpa_graph_tbps": kv_bytes / anchor_graph / 1e6,
            "graph_speedup": anchor_graph / ours_graph,
            "triton_graph20_us": ours_20,
            "triton_graph20_tbps": kv_bytes / ours_20 / 1e6,
            "sdpa_graph20_us": anchor_20,
            "sdpa_graph20_tbps": kv_bytes / anchor_20 / 1e6,
            "graph20_speedup": anchor_20 / ours_20,
            "gather_floor_graph20_us": floor_20,
            "gather_floor_graph20_tbps": kv_bytes / floor_20 / 1e6,
            "sdpa_over_gather_floor": anchor_20 / floor_20,
            "contiguous_floor_graph20_us": contiguous_floor_20,
            "sdpa_over_contiguous_floor": anchor_20 / contiguous_floor_20,
            "graph20_input_sets": len(case.inputs),
            "goal": DECODE_GOALS.get((batch, length)),
            "num_splits": plan["num_splits"],
            "plan": plan,
        }
        rows.append(row)
        log(
            f"decode B={batch:<4} L={length:<6} eager: triton {ours:7.1f} us, sdpa {anchor:7.1f} us, "
            f"x{row['speedup']:.2f} | graph: triton {ours_graph:7.1f} us, sdpa {anchor_graph:7.1f} us, "
            f"x{row['graph_speedup']:.2f} | graph x{GRAPH_CALLS}: triton {ours_20:7.1f} us "
            f"{row['triton_graph20_tbps']:4.2f} TB/s, sdpa {anchor_20:7.1f} us "
            f"{row['sdpa_graph20_tbps']:4.2f} TB/s, x{row['graph20_speedup']:.2f}, gather floor "
            f"{floor_20:.1f} us (x{row['sdpa_over_gather_floor']:.2f}), contiguous floor "
            f"{contiguous_floor_20:.1f} us (x{row['sdpa_over_contiguous_floor']:.2f}) [{describe(plan)}]"
        )
        if batch <= 8:
            # Diagnostic: the same shape with consecutive block ids (a contiguous working set).
            consecutive = torch.arange(
                batch * (length // BLOCK_SIZE), dtype=torch.int32, device=pool.k.device
            )
            seq_inputs = {**case.inputs[0], "block_tables": consecutive.view(batch, -1)}
            fn = functools.partial(ta.paged_attention, **seq_inputs, out=case.outs[0])
            row["triton_graph_us_consecutive_blocks"] = bench(as_graph(fn))
            log(f"   graph, consecutive block ids: {row['triton_graph_us_consecutive_blocks']:.1f} us")
        if batch == 1:
            row["host_us_per_call"] = {"triton": host_us_per_call(ours_fn), "sdpa": host_us_per_call(sdpa_fn)}
            log(f"   host time per eager call: {fmt_us(row['host_us_per_call'])}")
        if sweep:
            shape_deadline = time.time() + (deadline - time.time()) / (len(K1_SHAPES) - index)
            row["sweep"] = sweep_decode(case, results["sm_count"], shape_deadline)
        del case


def fmt_us(values: dict) -> str:
    return ", ".join(f"{k} {v:.1f} us" for k, v in values.items())


def sweep_decode(case: DecodeCase, sm_count: int, deadline: float) -> list[dict]:
    """Decode configs x split counts on one shape, each timed from a 20-call graph; prints the best.

    Split counts that round to the same partition as one already timed are skipped.
    """
    inputs = case.inputs[0]
    reference_out = ta.paged_attention(**inputs).float()
    small = case.batch * NUM_KV_HEADS < 2 * 4 * sm_count
    found, seen = [], set()
    for config in DECODE_SWEEP:
        for splits in SMALL_BATCH_SPLITS if small else LARGE_BATCH_SPLITS:
            plan = plan_summary(inputs, config, splits)
            key = (config, plan["num_splits"])
            if key in seen or (splits > 1 and plan["num_splits"] == 1):
                continue
            seen.add(key)
            if time.time() > deadline:
                found.append({"plan": plan, "skipped": "sweep budget spent"})
                continue
            try:
                fns = case.ours(decode_config=config, num_splits=splits)
                fns[0]()
                err = max_error(case.outs[0], reference_out)
                us = per_call_us(fns, quick=True)
            except Exception as exc:  # a config that does not compile or run is skipped
                found.append({"plan": plan, "error": repr(exc)[:200]})
                continue
            found.append({"plan": plan, "us": us, "err_vs_default": err})
    ranked = sorted((f for f in found if "us" in f), key=lambda f: f["us"])
    for f in ranked[:3]:
        log(
            f"   sweep (graph x{GRAPH_CALLS}) B={case.batch} L={case.length}: {describe(f['plan'])}: "
            f"{f['us']:.1f} us {case.kv_bytes / f['us'] / 1e6:.2f} TB/s (err {f['err_vs_default']:.1e})"
        )
    skipped = sum("skipped" in f for f in found)
    if skipped:
        log(f"   sweep B={case.batch} L={case.length}: {skipped} settings left out (budget)")
    return found


def prefill_inputs(pool: Pool) -> dict:
    device = pool.k.device
    tokens = PREFILL_SEQS * PREFILL_LEN
    return dict(
        q=torch.randn(tokens, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device),
        k_cache=pool.k,
        v_cache=pool.v,
        block_tables=pool.block_tables(PREFILL_SEQS, PREFILL_LEN // BLOCK_SIZE),
        seq_lens=torch.full((PREFILL_SEQS,), PREFILL_LEN, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(0, tokens + 1, PREFILL_LEN, dtype=torch.int32, device=device),
        scale=HEAD_DIM**-0.5,
    )


def time_prefill(pool: Pool, results: dict, sweep: bool, deadline: float) -> bool:
    inputs = prefill_inputs(pool)
    out = torch.empty_like(inputs["q"])
    ta.paged_attention(**inputs, out=out)
    ref = reference.paged_attention(**{**inputs, "q": inputs["q"].float()})
    err = max_error(out, ref)
    passed = err < BF16_TOLERANCE and not out.isnan().any().item()
    log(f"check prefill {PREFILL_SEQS}x{PREFILL_LEN} max|err|={err:.2e} {'ok' if passed else 'FAIL'}")
    del ref
    flops = 4 * PREFILL_SEQS * NUM_Q_HEADS * PREFILL_LEN**2 * HEAD_DIM / 2
    ours = bench(lambda: ta.paged_attention(**inputs, out=out))
    q4 = inputs["q"].view(PREFILL_SEQS, PREFILL_LEN, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    k, v = contiguous_kv(pool, inputs["block_tables"], PREFILL_LEN)
    sdpa_out = F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True)
    sdpa_err = max_error(sdpa_out.transpose(1, 2).reshape_as(out), out)
    anchor = bench(lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True))
    config = chosen_prefill_config([PREFILL_LEN] * PREFILL_SEQS, results["sm_count"])
    row = {
        "seqs": PREFILL_SEQS,
        "length": PREFILL_LEN,
        "triton_us": ours,
        "triton_tflops": flops / ours / 1e6,
        "sdpa_us": anchor,
        "sdpa_tflops": flops / anchor / 1e6,
        "speedup": anchor / ours,
        "goal": PREFILL_GOAL,
        "max_abs_err": err,
        "max_abs_diff_vs_sdpa": sdpa_err,
        "config": asdict(config),
    }
    results["prefill"] = row
    log(
        f"prefill {PREFILL_SEQS}x{PREFILL_LEN} triton {ours:8.1f} us {row['triton_tflops']:6.1f} TFLOP/s | "
        f"sdpa {anchor:8.1f} us {row['sdpa_tflops']:6.1f} TFLOP/s | x{row['speedup']:.2f} "
        f"(|ours-sdpa| {sdpa_err:.1e}) [{tuple(asdict(config).values())}]"
    )
    if sweep:
        row["sweep"] = sweep_prefill(inputs, out, sdpa_out.transpose(1, 2).reshape_as(out), flops, deadline)
        row["tile_choice"] = sweep_prefill_tiles(pool, results["sm_count"])
    return passed


WINDOW = 1024
WINDOW_DECODE = (64, 4096)


def time_window(pool: Pool, results: dict) -> bool:
    """Sliding-window decode and prefill against the same calls without a window (see the module
    docstring); each windowed output checked against the reference with the window."""
    batch, length = WINDOW_DECODE
    case = make_decode_case(pool, batch, length, results["l2_bytes"])
    inputs = case.inputs[0]
    out = ta.paged_attention(**inputs, sliding_window=WINDOW)
    ref = reference.paged_attention(**{**inputs, "q": inputs["q"].float()}, sliding_window=WINDOW)
    err = max_error(out, ref)
    passed = err < BF16_TOLERANCE and not out.isnan().any().item()
    full = per_call_us(case.ours())
    windowed = per_call_us(case.ours(sliding_window=WINDOW))
    short = per_call_us(make_decode_case(pool, batch, WINDOW, results["l2_bytes"]).ours())
    row = {
        "window": WINDOW,
        "decode": {"batch": batch, "context": length, "full_us": full, "window_us": windowed,
                   "context_of_window_us": short, "speedup": full / windowed, "max_abs_err": err},
    }  # fmt: skip
    log(
        f"window {WINDOW}: decode B={batch} L={length} graph x{GRAPH_CALLS}: full {full:.1f} us, windowed "
        f"{windowed:.1f} us (x{full / windowed:.2f}), L={WINDOW} without window {short:.1f} us "
        f"[err {err:.1e} {'ok' if passed else 'FAIL'}]"
    )
    prefill = prefill_inputs(pool)
    prefill_out = torch.empty_like(prefill["q"])
    ta.paged_attention(**prefill, out=prefill_out, sliding_window=WINDOW)
    ref = reference.paged_attention(**{**prefill, "q": prefill["q"].float()}, sliding_window=WINDOW)
    prefill_err = max_error(prefill_out, ref)
    passed &= prefill_err < BF16_TOLERANCE and not prefill_out.isnan().any().item()
    del ref
    full = bench(lambda: ta.paged_attention(**prefill, out=prefill_out))
    windowed = bench(lambda: ta.paged_attention(**prefill, out=prefill_out, sliding_window=WINDOW))
    row["prefill"] = {"seqs": PREFILL_SEQS, "length": PREFILL_LEN, "full_us": full, "window_us": windowed,
                      "speedup": full / windowed, "max_abs_err": prefill_err}  # fmt: skip
    log(
        f"window {WINDOW}: prefill {PREFILL_SEQS}x{PREFILL_LEN} eager: full {full:.1f} us, windowed "
        f"{windowed:.1f} us (x{full / windowed:.2f}) [err {prefill_err:.1e}]"
    )
    results["window"] = row
    return passed


def chosen_prefill_config(q_lens: list[int], sm_count: int) -> ta.PrefillConfig:
    """The prefill tile `paged_attention` picks for a K1-shaped batch with these new tokens."""
    return ta.choose_prefill_config(
        sum(q_lens), len(q_lens), NUM_KV_HEADS, NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM, DTYPE, sm_count
    )


def sweep_prefill_tiles(pool: Pool, sm_count: int) -> list[dict]:
    """Default and tall prefill tiles on each of PREFILL_TILE_CASES (20-call graphs of the same
    inputs, so the host's launch cost is out), and which of the two the shape-based choice takes."""
    gen = torch.Generator().manual_seed(0)
    default, tall = ta.default_prefill_config(HEAD_DIM, DTYPE), ta.big_prefill_config()
    found = []
    for name, (q_lens, ctx) in PREFILL_TILE_CASES.items():
        inputs = mixed_inputs(pool, q_lens, ctx, gen)
        out = torch.empty_like(inputs["q"])
        times = {
            label: per_call_us([functools.partial(ta.paged_attention, **inputs, out=out, prefill_config=c)])
            for label, c in (("default", default), ("tall", tall))
        }
        chosen = chosen_prefill_config(q_lens, sm_count)
        found.append({"case": name, **{f"{k}_us": v for k, v in times.items()}, "chosen": asdict(chosen)})
        log(
            f"   prefill tiles, {name:<36} default {times['default']:7.1f} us, tall {times['tall']:7.1f} us, "
            f"chosen: {'tall' if chosen == tall else 'default'}"
        )
    return found


def sweep_prefill(
    inputs: dict, out: torch.Tensor, expected: torch.Tensor, flops: float, deadline: float
) -> list:
    """Prefill tile configs (block_m, block_n, warps, stages), eager (the call is ~1 ms: launch cost
    is noise); the error is against SDPA's output."""
    found = []
    for config in PREFILL_SWEEP:
        if time.time() > deadline:
            found.append({"config": asdict(config), "skipped": "sweep budget spent"})
            continue
        try:

            def run(config=config):
                return ta.paged_attention(**inputs, out=out, prefill_config=config)

            cfg_err = max_error(run(), expected)
            us = bench(run, quick=True)
        except Exception as exc:
            found.append({"config": asdict(config), "error": repr(exc)[:200]})
            log(f"   sweep prefill {tuple(asdict(config).values())}: failed {repr(exc)[:120]}")
            continue
        found.append({"config": asdict(config), "us": us, "tflops": flops / us / 1e6, "err_vs_sdpa": cfg_err})
        log(
            f"   sweep prefill {tuple(asdict(config).values())}: {us:.1f} us {flops / us / 1e6:.1f} TFLOP/s"
            f" (err vs sdpa {cfg_err:.1e})"
        )
    return found


def met_text(ratio: float, goal: float | None) -> str:
    return "-" if goal is None else ("yes" if ratio >= goal else "NO")


def print_table(results: dict) -> None:
    """Eager, one-call graph and 20-call graph timings; goals are judged on the 20-call column."""
    log("")
    log(
        f"{'case':<21}{'eager':>8}{'sdpa':>8}{'ratio':>6} |{'graph':>8}{'sdpa':>8}{'ratio':>6} |"
        f"{'x20/call':>9}{'sdpa':>8}{'ratio':>6} |{'triton':>10}{'sdpa':>10} |{'goal':>5}  met |"
        f"{'floor':>7}{'max ratio':>10}{'contig':>8}{'max ratio':>10}"
    )
    for r in results["decode"]:
        name = f"decode B={r['batch']} L={r['context']}"
        goal = r["goal"]
        log(
            f"{name:<21}{r['triton_us']:>8.1f}{r['sdpa_us']:>8.1f}{r['speedup']:>6.2f} |"
            f"{r['triton_graph_us']:>8.1f}{r['sdpa_graph_us']:>8.1f}{r['graph_speedup']:>6.2f} |"
            f"{r['triton_graph20_us']:>9.1f}{r['sdpa_graph20_us']:>8.1f}{r['graph20_speedup']:>6.2f} |"
            f"{r['triton_graph20_tbps']:>6.2f}TB/s{r['sdpa_graph20_tbps']:>6.2f}TB/s |"
            f"{'' if goal is None else goal:>5}  {met_text(r['graph20_speedup'], goal):<3} |"
            f"{r['gather_floor_graph20_us']:>7.1f}{r['sdpa_over_gather_floor']:>10.2f}"
            f"{r['contiguous_floor_graph20_us']:>8.1f}{r['sdpa_over_contiguous_floor']:>10.2f}"
        )
    p = results["prefill"]
    name = f"prefill {p['seqs']}x{p['length']}"
    log(
        f"{name:<21}{p['triton_us']:>8.1f}{p['sdpa_us']:>8.1f}{p['speedup']:>6.2f} |{'':>22} |{'':>23} |"
        f"{p['triton_tflops']:>4.0f}TFLOP/s{p['sdpa_tflops']:>4.0f}TFLOP/s |{p['goal']:>5}  "
        f"{met_text(p['speedup'], p['goal'])}"
    )
    log(
        "times in us per call. eager: do_bench of the Python call; graph: replay of a graph of one call "
        "(bound by the host's replay rate for small kernels);"
    )
    log(
        f"x20/call: one graph of {GRAPH_CALLS} back-to-back calls over different KV (as the layers of a "
        f"decode step), total / {GRAPH_CALLS}."
    )
    log(
        "Decode goals (ratio = sdpa / ours >= goal) are judged on x20/call, and the TB/s columns come "
        "from it; prefill is judged eager (one ~1 ms call)."
    )
    log(
        "floor: x20/call of a kernel that only gathers the same paged K/V (no math, no merge); "
        "max ratio = sdpa / floor, the most a kernel of this design could reach. contig: the same "
        "reads from SDPA's contiguous K/V (no block table), a bound for any kernel."
    )
    w = results.get("window")
    if w:
        d, p = w["decode"], w["prefill"]
        log(
            f"window {w['window']}: decode B={d['batch']} L={d['context']} {d['window_us']:.1f} us vs "
            f"{d['full_us']:.1f} us without (x{d['speedup']:.2f}; L={w['window']} without: "
            f"{d['context_of_window_us']:.1f} us); prefill {p['seqs']}x{p['length']} {p['window_us']:.1f} us "
            f"vs {p['full_us']:.1f} us (x{p['speedup']:.2f})"
        )
    log(f"correctness: {'all ok' if results['correct'] else 'FAILURES'}")


def print_sweep_summary(results: dict) -> None:
    """Best setting per shape next to the default; how to adopt them is printed below the list."""
    log("")
    log(f"sweep summary: best setting per shape (decode: us per call in a {GRAPH_CALLS}-call graph)")
    for r in results["decode"]:
        timed = sorted((f for f in r.get("sweep", []) if "us" in f), key=lambda f: f["us"])
        if not timed:
            continue
        best = timed[0]
        log(
            f"  decode B={r['batch']:<4} L={r['context']:<6} default {r['triton_graph20_us']:7.1f} us "
            f"[{describe(r['plan'])}] | best {best['us']:7.1f} us [{describe(best['plan'])}] "
            f"x{r['triton_graph20_us'] / best['us']:.2f} vs default | best vs sdpa "
            f"x{r['sdpa_graph20_us'] / best['us']:.2f}"
        )
    p = results["prefill"]
    timed = sorted((f for f in p.get("sweep", []) if "us" in f), key=lambda f: f["us"])
    if timed:
        best = timed[0]
        log(
            f"  prefill {p['seqs']}x{p['length']} default {p['triton_us']:7.1f} us "
            f"{tuple(p['config'].values())} | best {best['us']:7.1f} us {tuple(best['config'].values())} "
            f"(block_m, block_n, warps, stages) x{p['sdpa_us'] / best['us']:.2f} of sdpa"
        )
    log(
        "  adopt: a single-tile winner (keys/split == bn) -> single_tile_decode_config; a looping "
        "winner -> default_decode_config and the split policy in choose_num_splits; prefill -> "
        "default_prefill_config or big_prefill_config (kernels/triton_attention.py)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--result-file", default="bench-results/kernels.json")
    parser.add_argument("--sweep", action="store_true", help="also time other configs and split counts")
    parser.add_argument(
        "--sweep-budget-s", type=float, default=200.0, help="seconds from the start the whole run may take"
    )
    parser.add_argument("--pool-blocks", type=int, default=131072, help="blocks in the paged pool")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA device"
    device = torch.device("cuda")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    results: dict = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", 50 * 2**20),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pool_blocks": args.pool_blocks,
        "graph_calls": GRAPH_CALLS,
    }
    log(
        f"{props.name}, {props.multi_processor_count} SMs, L2 {results['l2_bytes'] / 2**20:.0f} MiB, "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    start = time.time()
    pool = Pool(args.pool_blocks, device)
    correct = check_correctness(pool, results)
    # The decode sweep gets 70% of the budget, the prefill sweep what is left.
    time_decode(pool, results, args.sweep, start + 0.7 * args.sweep_budget_s)
    correct &= time_prefill(pool, results, args.sweep, start + args.sweep_budget_s)
    correct &= time_window(pool, results)
    results["correct"] = bool(correct)
    results["wall_s"] = time.time() - start
    path = Path(args.result_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print_table(results)
    if args.sweep:
        print_sweep_summary(results)
    log(f"wrote {path} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
