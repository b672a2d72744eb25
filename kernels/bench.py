"""Benchmark of the Triton paged-attention kernels against SDPA on contiguous tensors (run on a GPU).

    python -m kernels.bench [--result-file bench-results/kernels.json] [--sweep]

1. Correctness: workload K1's decode shapes, mixed prefill/decode batches and the prefill case, each
   against `kernels.reference` in fp32 (max abs error printed, checked against a tolerance).
2. Timing, median of `triton.testing.do_bench` (which flushes L2 before every repetition), both of
   the eager call and of a CUDA-graph replay of it (what the executor runs for decode steps; it
   leaves out the host's launch cost), for ours and for the anchor alike:
   * K1 decode: bf16, 32 query / 8 KV heads, head_dim 128, block_size 16, random block tables over
     a pool much larger than the working set; the anchor is
     `scaled_dot_product_attention(..., enable_gqa=True)` on a contiguous cache of the same shape.
     Bandwidth counts the KV bytes read, B * L * 2 * 8 * 128 * 2.
   * Prefill: 8 sequences x 2048 tokens, causal, 32/8 heads, head_dim 128, bf16, against SDPA's
     causal attention on contiguous tensors; TFLOP/s counts 4 * S * H * T^2 * D / 2.
3. `--sweep` also times other tile configurations and split counts (for tuning the defaults).

A line per case shows progress; a short table comes last; the JSON holds everything.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from kernels import reference
from kernels import triton_attention as ta

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
K1_SHAPES = [(1, 4096), (8, 4096), (64, 1024), (64, 4096), (256, 1024), (32, 16384)]
PREFILL_SEQS, PREFILL_LEN = 8, 2048
# Decode goals: ratio of our KV bandwidth to the anchor's.
DECODE_GOALS = {(1, 4096): 2.0, (8, 4096): 1.2, (64, 4096): 0.9, (256, 1024): 0.9, (32, 16384): 0.9}
PREFILL_GOAL = 0.6
BF16_TOLERANCE = 2e-2

DECODE_SWEEP = [
    ta.DecodeConfig(64, 4, 3),
    ta.DecodeConfig(64, 4, 2),
    ta.DecodeConfig(32, 4, 3),
    ta.DecodeConfig(128, 4, 3),
]
PREFILL_SWEEP = [
    ta.PrefillConfig(64, 64, 4, 3),
    ta.PrefillConfig(64, 64, 4, 2),
    ta.PrefillConfig(128, 128, 8, 3),
    ta.PrefillConfig(128, 64, 8, 3),
    ta.PrefillConfig(64, 32, 4, 3),
    ta.PrefillConfig(128, 128, 8, 2),
]


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

    The executor replays decode steps from graphs, so this is the time that counts there; it also
    takes the host's launch cost (Python wrapper, Triton's launcher) out of the measurement.
    """
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


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


def time_decode(pool: Pool, results: dict, sweep: bool) -> None:
    """K1: eager and CUDA-graph timings of ours and of the anchor; goals are judged on both."""
    rows = results.setdefault("decode", [])
    for batch, length in K1_SHAPES:
        inputs = decode_inputs(pool, batch, length)
        out = torch.empty_like(inputs["q"])

        def ours_fn(inputs=inputs, out=out):
            return ta.paged_attention(**inputs, out=out)

        k, v = contiguous_kv(pool, inputs["block_tables"], length)
        q4 = inputs["q"].unsqueeze(2)  # [B, H, 1, D]

        def sdpa_fn(q4=q4, k=k, v=v):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

        ours, anchor = bench(ours_fn), bench(sdpa_fn)
        ours_graph, anchor_graph = bench(as_graph(ours_fn)), bench(as_graph(sdpa_fn))
        kv_bytes = batch * length * 2 * NUM_KV_HEADS * HEAD_DIM * 2
        config = ta.default_decode_config(HEAD_DIM, DTYPE)
        splits = ta.choose_num_splits(batch, NUM_KV_HEADS, length, config.block_n, ta._sm_count(q4.device))
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
            "goal": DECODE_GOALS.get((batch, length)),
            "num_splits": splits,
            "config": asdict(config),
        }
        rows.append(row)
        log(
            f"decode B={batch:<4} L={length:<6} eager: triton {ours:7.1f} us {row['triton_tbps']:4.2f} TB/s, "
            f"sdpa {anchor:7.1f} us {row['sdpa_tbps']:4.2f} TB/s, x{row['speedup']:.2f} | graph: triton "
            f"{ours_graph:7.1f} us {row['triton_graph_tbps']:4.2f} TB/s, sdpa {anchor_graph:7.1f} us "
            f"{row['sdpa_graph_tbps']:4.2f} TB/s, x{row['graph_speedup']:.2f} (splits={splits})"
        )
        if batch <= 8:
            # Diagnostic: the same shape with consecutive block ids (a contiguous working set).
            consecutive = torch.arange(batch * (length // BLOCK_SIZE), dtype=torch.int32, device=out.device)
            seq_inputs = {**inputs, "block_tables": consecutive.view(batch, -1)}
            row["triton_graph_us_consecutive_blocks"] = bench(
                as_graph(lambda seq_inputs=seq_inputs, out=out: ta.paged_attention(**seq_inputs, out=out))
            )
            log(f"   graph, consecutive block ids: {row['triton_graph_us_consecutive_blocks']:.1f} us")
        if batch == 1:
            row["host_us_per_call"] = {"triton": host_us_per_call(ours_fn), "sdpa": host_us_per_call(sdpa_fn)}
            log(f"   host time per eager call: {row['host_us_per_call']}")
        if sweep and batch * NUM_KV_HEADS < 3 * ta._sm_count(q4.device):
            row["sweep"] = sweep_decode(inputs, out, kv_bytes)
        del k, v


def sweep_decode(inputs: dict, out: torch.Tensor, kv_bytes: int) -> list[dict]:
    """Sweep configurations x split counts on one shape, timed from CUDA graphs; prints the best."""
    batch, length = inputs["q"].shape[0], inputs["block_tables"].shape[1] * BLOCK_SIZE
    reference_out = ta.paged_attention(**inputs).float()
    found = []
    for config in DECODE_SWEEP:
        for splits in (1, 4, 8, 16, 24, 32, 48, 64):
            if splits > 1 and length // splits < config.block_n:
                continue
            try:

                def run(config=config, splits=splits):
                    return ta.paged_attention(**inputs, out=out, decode_config=config, num_splits=splits)

                err = max_error(run(), reference_out)
                us = bench(as_graph(run), quick=True)
            except Exception as exc:  # a config that does not compile or run is skipped
                found.append({"config": asdict(config), "splits": splits, "error": repr(exc)[:200]})
                continue
            found.append({"config": asdict(config), "splits": splits, "us": us, "err_vs_default": err})
    ranked = sorted((f for f in found if "us" in f), key=lambda f: f["us"])
    for f in ranked[:4]:
        c = f["config"]
        log(
            f"   sweep (graph) B={batch} L={length}: bn={c['block_n']} w={c['num_warps']} "
            f"s={c['num_stages']} splits={f['splits']}: {f['us']:.1f} us {kv_bytes / f['us'] / 1e6:.2f} TB/s "
            f"(err {f['err_vs_default']:.1e})"
        )
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


def time_prefill(pool: Pool, results: dict, sweep: bool) -> bool:
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
    config = ta.default_prefill_config(HEAD_DIM, DTYPE)
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
        f"(|ours-sdpa| {sdpa_err:.1e})"
    )
    if sweep:
        found = []
        for config in PREFILL_SWEEP:
            try:

                def run(config=config):
                    return ta.paged_attention(**inputs, out=out, prefill_config=config)

                cfg_err = max_error(run(), sdpa_out.transpose(1, 2).reshape_as(out))
                us = bench(run, quick=True)
            except Exception as exc:
                found.append({"config": asdict(config), "error": repr(exc)[:200]})
                log(f"   sweep prefill {asdict(config)}: failed {repr(exc)[:120]}")
                continue
            found.append(
                {"config": asdict(config), "us": us, "tflops": flops / us / 1e6, "err_vs_sdpa": cfg_err}
            )
            log(
                f"   sweep prefill {tuple(asdict(config).values())}: "
                f"{us:.1f} us {flops / us / 1e6:.1f} TFLOP/s"
            )
        row["sweep"] = found
    return passed


def print_table(results: dict) -> None:
    """Eager (do_bench on the Python call) and graph (do_bench on a CUDA graph replay) timings."""
    log("")
    log(
        f"{'case':<21}{'eager us':>9}{'sdpa us':>9}{'ratio':>7} |{'graph us':>9}{'sdpa us':>9}"
        f"{'ratio':>7} |{'triton':>12}{'sdpa':>12} |{'goal':>5}  met(eager/graph)"
    )
    for r in results["decode"]:
        goal = r["goal"]
        met = (
            "-"
            if goal is None
            else "/".join("yes" if x >= goal else "NO" for x in (r["speedup"], r["graph_speedup"]))
        )
        name = f"decode B={r['batch']} L={r['context']}"
        goal_text = "" if goal is None else f"{goal}"
        log(
            f"{name:<21}{r['triton_us']:>9.1f}{r['sdpa_us']:>9.1f}{r['speedup']:>7.2f} |"
            f"{r['triton_graph_us']:>9.1f}{r['sdpa_graph_us']:>9.1f}{r['graph_speedup']:>7.2f} |"
            f"{r['triton_graph_tbps']:>7.2f}TB/s{r['sdpa_graph_tbps']:>7.2f}TB/s |{goal_text:>5}  {met}"
        )
    p = results["prefill"]
    met = "yes" if p["speedup"] >= p["goal"] else "NO"
    name = f"prefill {p['seqs']}x{p['length']}"
    log(
        f"{name:<21}{p['triton_us']:>9.1f}{p['sdpa_us']:>9.1f}{p['speedup']:>7.2f} |{'':>25} |"
        f"{p['triton_tflops']:>6.0f}TFLOP/s{p['sdpa_tflops']:>5.0f}TFLOP/s |{p['goal']:>5}  {met}"
    )
    log("decode TB/s columns are from the graph timings; prefill is eager only")
    log(f"correctness: {'all ok' if results['correct'] else 'FAILURES'}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--result-file", default="bench-results/kernels.json")
    parser.add_argument("--sweep", action="store_true", help="also time other configs and split counts")
    parser.add_argument("--pool-blocks", type=int, default=131072, help="blocks in the paged pool")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA device"
    device = torch.device("cuda")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(device)
    results: dict = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pool_blocks": args.pool_blocks,
    }
    log(
        f"{props.name}, {props.multi_processor_count} SMs, "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    start = time.time()
    pool = Pool(args.pool_blocks, device)
    correct = check_correctness(pool, results)
    time_decode(pool, results, args.sweep)
    correct &= time_prefill(pool, results, args.sweep)
    results["correct"] = bool(correct)
    results["wall_s"] = time.time() - start
    path = Path(args.result_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print_table(results)
    log(f"wrote {path} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
