"""The fused-MoE Triton kernels (`kernels.triton_moe`) against the reference (`kernels.reference`).

Off the GPU the kernels run under the interpreter with tiny shapes: several experts, top-k 1, 2
and 8, tokens routed unevenly (one expert takes most, some take none), hidden and intermediate
sizes that are not multiples of the tiles. CUDA adds Qwen3-30B-A3B's and Mixtral's layer shapes,
both FP8 modes and a CUDA graph. Every check draws fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import fp8, reference
from pagedserve.kernels import triton_moe as tm
from tests.triton_marks import DEVICE, INTERPRETED, needs_cuda, needs_triton

FP8 = torch.float8_e4m3fn


def make_moe(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    *,
    fp8_weights: bool = False,
    idle_experts: int = 2,
    device: str = DEVICE,
    seed: int = 0,
) -> dict:
    """Random inputs of `fused_moe`: weights scaled so activations stay O(1), routing by softmax
    over biased logits (expert 1 takes most tokens, the last `idle_experts` none), renormalised
    top-k weights. FP8: weights quantized per output row as the loader does."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 1] += 3.0
    if idle_experts:
        logits[:, -idle_experts:] = float("-inf")
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    args = dict(
        x=x.to(dtype).to(device),
        topk_weights=weights.float().to(device),
        topk_ids=ids.to(torch.int32).to(device),
    )
    if fp8_weights:
        (w13, s13), (w2, s2) = fp8.quantize_weight(w13.flatten(0, 1)), fp8.quantize_weight(w2.flatten(0, 1))
        args.update(
            w13=w13.view(num_experts, 2 * inter, hidden).to(device),
            w2=w2.view(num_experts, hidden, inter).to(device),
            w13_scale=s13.view(num_experts, 2 * inter).float().to(device),
            w2_scale=s2.view(num_experts, hidden).float().to(device),
        )
    else:
        args.update(w13=w13.to(dtype).to(device), w2=w2.to(dtype).to(device))
    return args


def reference_moe(args: dict) -> torch.Tensor:
    return reference.fused_moe(**args).float().cpu()


def w8a8_reference(args: dict) -> torch.Tensor:
    """The FP8-activation mode's math in plain torch: x quantized per token, the intermediate
    rounded to x's dtype and quantized per row, FP8 weights times their row scales."""
    x, w13, w2 = args["x"], args["w13"], args["w2"]
    inter = w2.shape[2]
    xq = fp8.dequantize(*fp8.quantize_per_token_reference(x))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    top_k = args["topk_ids"].shape[1]
    flat_ids = args["topk_ids"].reshape(-1).long()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(top_k)
    for expert in flat_ids.unique().tolist():
        rows = (flat_ids == expert).nonzero().squeeze(1)
        tokens = token_of[rows]
        gate_up = xq[tokens] @ (w13[expert].float() * args["w13_scale"][expert][:, None]).T
        h = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        hq = fp8.dequantize(*fp8.quantize_per_token_reference(h))
        down = hq @ (w2[expert].float() * args["w2_scale"][expert][:, None]).T
        out.index_add_(0, tokens, down * args["topk_weights"].reshape(-1)[rows, None])
    return out.to(x.dtype).float().cpu()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max error within `rel` of the output's largest magnitude (outputs are O(1))."""
    actual = actual.float().cpu()
    assert not actual.isnan().any(), "output has NaN"
    err = (actual - expected).abs().max().item()
    assert err <= rel * expected.abs().max().item() + 1e-6, f"max |err| {err:.3e}"


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


# --------------------------------------------------------------------------------------------- #
# Sorting into expert blocks (`align`: two Triton kernels)
# --------------------------------------------------------------------------------------------- #


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """(sorted ids up to num_rows, block experts) in plain Python: each expert's assignments in
    token order, padded with the sentinel to a multiple of block_m; no block for an idle expert."""
    flat = topk_ids.flatten().tolist()
    sorted_ids: list[int] = []
    block_experts: list[int] = []
    for expert in range(num_experts):
        rows = [i for i, e in enumerate(flat) if e == expert]
        padded = -(-len(rows) // block_m) * block_m
        sorted_ids += rows + [len(flat)] * (padded - len(rows))
        block_experts += [expert] * (padded // block_m)
    return sorted_ids, block_experts


@needs_triton
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_sorts_assignments_into_blocks_of_one_expert(block_m: int) -> None:
    """Every assignment once, each block one expert's, padded with the sentinel, experts without
    a token no block; the device-side row count covers exactly the real blocks."""
    num_experts = 7
    ids = torch.tensor([[1, 3], [1, 0], [3, 1], [5, 1], [1, 3]], dtype=torch.int32, device=DEVICE)
    sorted_ids, block_experts, num_rows = tm.align(ids, num_experts, block_m)
    flat = ids.flatten().tolist()
    sentinel = len(flat)
    assert sorted_ids.shape[0] == tm._max_sorted_rows(len(flat), num_experts, block_m)
    assert block_experts.shape[0] == -(-sorted_ids.shape[0] // block_m)
    rows = int(num_rows)
    assert rows % block_m == 0
    real = [i for i in sorted_ids[:rows].tolist() if i != sentinel]
    assert sorted(real) == list(range(len(flat)))
    for b in range(rows // block_m):
        block = [i for i in sorted_ids[b * block_m : (b + 1) * block_m].tolist() if i != sentinel]
        assert block, "a block with no assignment"
        assert {flat[i] for i in block} == {int(block_experts[b])}
    counts = {e: flat.count(e) for e in range(num_experts)}
    assert rows == sum(-(-c // block_m) * block_m for c in counts.values())
    used = set(block_experts[: rows // block_m].tolist())
    assert used == {e for e, c in counts.items() if c}  # experts 2, 4, 6 have none


@needs_triton
@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, block_m",
    [(1, 8, 1, 16), (37, 8, 2, 16), (300, 12, 4, 1), (200, 16, 3, 64), (70, 128, 8, 16), (45, 128, 8, 128)],
)
def test_align_matches_reference(
    num_tokens: int, num_experts: int, top_k: int, block_m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random routings (distinct experts per token, a quarter of the experts idle), several chunks
    of assignments (chunks of 128 here instead of up to 512: an expert's assignments in earlier
    chunks carry over; the scatter reads the count table 2 chunks a step instead of 64), int32 and
    int64 ids: exactly the reference's order, blocks and row count."""
    monkeypatch.setattr(tm, "_ALIGN_CHUNK", tm._ALIGN_MIN_CHUNK)
    monkeypatch.setattr(tm, "_ALIGN_TABLE_ROWS", 2)
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    active = max(top_k, num_experts - num_experts // 4)
    experts = torch.randperm(num_experts, generator=gen)[:active]
    picks = torch.stack([torch.randperm(active, generator=gen)[:top_k] for _ in range(num_tokens)])
    for dtype in (torch.int32, torch.int64):
        ids = experts[picks].to(dtype).to(DEVICE)
        sorted_ids, block_experts, num_rows = tm.align(ids, num_experts, block_m)
        want_ids, want_blocks = align_reference(ids.cpu(), num_experts, block_m)
        rows = int(num_rows)
        assert rows == len(want_ids) <= sorted_ids.shape[0]
        assert sorted_ids[:rows].tolist() == want_ids
        assert block_experts[: rows // block_m].tolist() == want_blocks


def test_tile_choice_follows_rows_per_expert() -> None:
    decode = tm.choose_config(64 * 8, 128, 768, 2048, True)
    prefill = tm.choose_config(8192 * 8, 128, 768, 2048, True)
    assert decode.block_m == 16 and prefill.block_m == 128
    for gate_up in (True, False):  # one sorting serves both GEMMs
        for fp8_weights, fp8_activations in ((False, False), (True, False), (True, True)):
            tiles = [tm.choose_config(rows, 128, 768, 2048, gate_up, fp8_weights, fp8_activations)
                     for rows in (64 * 8, 512 * 8, 8192 * 8)]  # fmt: skip
            shapes = [tm.choose_config(rows, 128, 768, 2048, not gate_up, fp8_weights, fp8_activations)
                      for rows in (64 * 8, 512 * 8, 8192 * 8)]  # fmt: skip
            assert [t.block_m for t in tiles] == [s.block_m for s in shapes] == [16, 64, 128]
    fp8_prefill = tm.choose_config(8192 * 8, 128, 2048, 768, False, True, True)
    assert (fp8_prefill.block_n, fp8_prefill.block_k) == (128, 128)
    assert tm.choose_config(64 * 8, 128, 2048, 768, False).block_n == 2 * decode.block_n
    tiny = tm.choose_config(10, 8, 40, 48, True)  # tiles no wider than the matrices need
    assert tiny.block_n == 64 and tiny.block_k == 64


# --------------------------------------------------------------------------------------------- #
# Triton against the reference
# --------------------------------------------------------------------------------------------- #


@needs_triton
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_moe_matches_reference(dtype: torch.dtype, top_k: int) -> None:
    """Uneven routing over 12 experts (two idle), hidden 80 and intermediate 40 (masked tails)."""
    args = make_moe(23, 12, top_k, 80, 40, dtype, seed=top_k)
    assert_close(tm.fused_moe(**args), reference_moe(args), TOLERANCE[dtype])


@needs_triton
@pytest.mark.parametrize(
    "block_m, block_n, block_k, group_m",
    [(16, 16, 16, 1), (16, 32, 16, 3), (32, 16, 32, 2)],
    ids=["16x16x16", "16x32x16-group3", "32x16x32-group2"],
)
def test_fused_moe_tile_configs(block_m: int, block_n: int, block_k: int, group_m: int) -> None:
    """Several reduction steps and column blocks per expert, grouped launch orders that do not
    divide the row blocks, different row blocks for the two GEMMs (each sorts its own)."""
    args = make_moe(19, 6, 2, 72, 48, torch.bfloat16, seed=block_m + block_n)
    gate_up = tm.MoeConfig(block_m, block_n, block_k, group_m, 4, 2)
    down = tm.MoeConfig(48 - block_m, block_k, block_n, 1, 4, 2)
    got = tm.fused_moe(**args, gate_up_config=gate_up, down_config=down)
    assert_close(got, reference_moe(args), TOLERANCE[torch.bfloat16])


@needs_triton
@pytest.mark.parametrize("mode", ["bf16", "fp8-widened"])
@pytest.mark.parametrize("flatten", [False, True])
def test_fused_moe_persistent_programs(mode: str, flatten: bool) -> None:
    """persistent: a few programs loop over all real tiles (under the interpreter 3 programs, each
    many tiles: several row blocks per expert, partial column blocks, a grouped order that does not
    divide the row blocks), with weights by pointer in gate_up and through TMA in down; the same
    result as one program per tile. flatten only changes what the compiler does with the loop."""
    args = make_moe(23, 6, 2, 72, 48, torch.bfloat16, fp8_weights=mode != "bf16", seed=11)
    persistent = dict(persistent=True, flatten=flatten)
    gate_up = tm.MoeConfig(16, 32, 32, 3, 4, 2, **persistent)
    down = tm.MoeConfig(16, 32, 32, 2, 4, 2, tma_weights=True, **persistent)
    device = args["x"].device
    programs = tm._sm_count(device.index) if device.type == "cuda" else tm._INTERPRETED_PROGRAMS
    assert tm._grid(gate_up, 1000, 48, device) == (min(63 * 2, programs),)  # 63 row blocks x 2
    got = tm.fused_moe(**args, fp8_activations=False, gate_up_config=gate_up, down_config=down)
    assert_close(got, reference_moe(args), TOLERANCE[torch.bfloat16])


@needs_triton
@pytest.mark.parametrize("mode", ["bf16", "fp8-widened", "fp8-activations"])
def test_fused_moe_weights_through_tma_descriptors(mode: str) -> None:
    """tma_weights: the weight tiles through descriptors (zeros past the rows and the reduction:
    hidden 72 and intermediate 48 leave partial tiles), the same result as pointer loads."""
    args = make_moe(19, 6, 2, 72 if mode == "bf16" else 64, 48, torch.bfloat16, fp8_weights=mode != "bf16",
                    seed=9)  # fmt: skip
    gate_up = tm.MoeConfig(16, 32, 32, 2, 4, 2, tma_weights=True)
    down = tm.MoeConfig(16, 64, 32, 1, 4, 2, tma_weights=True)
    assert tm._uses_tma(args["w13"], gate_up) and tm._uses_tma(args["w2"], down)
    options = dict(fp8_activations=mode == "fp8-activations", gate_up_config=gate_up, down_config=down)
    got = tm.fused_moe(**args, **options)
    if mode == "fp8-activations":
        assert_close(got, w8a8_reference(args), 3e-2)
    else:
        assert_close(got, reference_moe(args), TOLERANCE[torch.bfloat16])


@needs_triton
@pytest.mark.parametrize("mode", ["bf16", "fp8-widened", "fp8-activations", "float32"])
@pytest.mark.parametrize("tma_weights", [False, True])
def test_fused_moe_gate_up_as_one_product(mode: str, tma_weights: bool) -> None:
    """one_dot: the gate and up tiles as one operand of twice the width (by pointer, or one TMA
    box of w13 seen as [E, 2, inter, hidden]), intermediate 40 (a partial, wrapped column block)
    and hidden 72 (a partial reduction step): the same result as two products."""
    dtype = torch.float32 if mode == "float32" else torch.bfloat16
    fp8_weights = mode.startswith("fp8")
    args = make_moe(19, 6, 2, 64 if fp8_weights else 72, 40, dtype, fp8_weights=fp8_weights, seed=13)
    gate_up = tm.MoeConfig(16, 16, 32, 2, 4, 2, tma_weights=tma_weights, one_dot=True)
    down = tm.MoeConfig(16, 32, 32, 1, 4, 2)  # FP8 products reduce at least 32 deep
    options = dict(fp8_activations=mode == "fp8-activations", gate_up_config=gate_up, down_config=down)
    got = tm.fused_moe(**args, **options)
    if mode == "fp8-activations":
        assert_close(got, w8a8_reference(args), 3e-2)
    else:
        assert_close(got, reference_moe(args), TOLERANCE[dtype])


@needs_triton
def test_fused_moe_fp8_widened_weights_match_reference() -> None:
    """e4m3 weights widened to bf16 (exact) times their row scales: the reference's math."""
    args = make_moe(21, 10, 2, 64, 48, torch.bfloat16, fp8_weights=True, seed=5)
    got = tm.fused_moe(**args, fp8_activations=False)
    assert_close(got, reference_moe(args), TOLERANCE[torch.bfloat16])


@needs_triton
@pytest.mark.parametrize("top_k", [1, 8])
def test_fused_moe_fp8_activations_match_their_emulation(top_k: int) -> None:
    """FP8 activations: x and the intermediate quantized per row, as `w8a8_reference` does; and
    within a few percent of the bf16 reference (the quantization's own error)."""
    args = make_moe(17, 10, top_k, 64, 48, torch.bfloat16, fp8_weights=True, seed=6)
    got = tm.fused_moe(**args, fp8_activations=True)
    assert_close(got, w8a8_reference(args), 3e-2)
    assert_close(got, reference_moe(args), 0.15)


@needs_triton
@pytest.mark.parametrize("top_k, hidden", [(2, 1500), (8, 48), (3, 1024)])
def test_top_k_sum_matches_torch(top_k: int, hidden: int) -> None:
    """The combine over each token's top_k rows: a hidden size that splits into a partial column
    block, odd top_k; float32 accumulation, so the bf16 result rounds once (exactly torch's on
    CUDA; the interpreter's float32 -> bf16 conversion may differ by one unit in the last place)."""
    gen = torch.Generator().manual_seed(top_k * hidden)
    rows = torch.randn(5 * top_k, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.empty(5, hidden, dtype=torch.bfloat16, device=DEVICE)
    want = rows.float().view(5, top_k, hidden).sum(dim=1).to(torch.bfloat16)
    ulp = 2**-7 if INTERPRETED else 0.0
    torch.testing.assert_close(tm.sum_top_k(rows, out, top_k), want, rtol=ulp, atol=0)


@needs_triton
def test_fused_moe_with_no_tokens_and_one_token() -> None:
    args = make_moe(1, 8, 2, 32, 16, torch.float32)
    assert_close(tm.fused_moe(**args), reference_moe(args), TOLERANCE[torch.float32])
    empty = {**args, **{k: args[k][:0] for k in ("x", "topk_ids", "topk_weights")}}
    assert tm.fused_moe(**empty).shape == (0, 32)


def test_dispatch_uses_reference_on_cpu_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_ATTENTION", raising=False)
    monkeypatch.setattr(tm, "fused_moe", None)  # would fail if called
    args = make_moe(5, 4, 2, 16, 8, torch.float32, device="cpu")
    torch.testing.assert_close(kernels.fused_moe(**args), reference.fused_moe(**args))


@needs_triton
@pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs the interpreter")
def test_dispatch_forced_triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    args = make_moe(5, 4, 2, 16, 8, torch.float32, device="cpu")
    expected = reference_moe(args)
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "triton")
    monkeypatch.setattr(reference, "fused_moe", None)  # would fail if called
    assert_close(kernels.fused_moe(**args), expected, TOLERANCE[torch.float32])


# --------------------------------------------------------------------------------------------- #
# CUDA only: model shapes, CUDA graphs
# --------------------------------------------------------------------------------------------- #

QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden=2048, inter=768)


@needs_cuda
@pytest.mark.parametrize("mode", ["bf16", "fp8-widened", "fp8-activations"])
@pytest.mark.parametrize("num_tokens", [1, 64, 512, 3000])
def test_cuda_qwen3_moe_layer(num_tokens: int, mode: str) -> None:
    """Qwen3-30B-A3B's layer (128 experts, top-8, hidden 2048, width 768), at decode and prefill
    sizes (each picking its own tiles), no idle expert and 16 idle ones; TP=2's half width too."""
    for idle, inter in ((0, 768), (16, 384)):
        shape = {**QWEN3_30B_A3B, "inter": inter}
        args = make_moe(num_tokens, *shape.values(), torch.bfloat16, fp8_weights=mode != "bf16",
                        idle_experts=idle, seed=num_tokens)  # fmt: skip
        got = tm.fused_moe(**args, fp8_activations=mode == "fp8-activations")
        if mode == "fp8-activations":
            # FP8 operands accumulate inside tl.dot at Hopper's reduced precision (vLLM's kernel and
            # _scaled_mm's fast accumulation do too); the fp32 reference rounds once per element.
            assert_close(got, w8a8_reference(args), 5e-2)
            assert_close(got, reference_moe(args), 0.1)
        else:
            assert_close(got, reference_moe(args), TOLERANCE[torch.bfloat16])


@needs_cuda
def test_cuda_mixtral_moe_layer() -> None:
    """Mixtral-8x7B's layer: 8 experts, top-2, hidden 4096, width 14336 (bf16, and FP8 widened)."""
    for fp8_weights in (False, True):
        args = make_moe(37, 8, 2, 4096, 14336, torch.bfloat16, fp8_weights=fp8_weights, idle_experts=1)
        assert_close(tm.fused_moe(**args), reference_moe(args), TOLERANCE[torch.bfloat16])


@needs_cuda
def test_cuda_graph_capture_of_fused_moe() -> None:
    """Captured once (sorting included: no host synchronisation); replays follow new routings and
    inputs copied in place."""
    args = make_moe(64, **QWEN3_30B_A3B, dtype=torch.bfloat16, seed=1)
    tm.fused_moe(**args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tm.fused_moe(**args)
    for step in range(3):
        fresh = make_moe(64, **QWEN3_30B_A3B, dtype=torch.bfloat16, idle_experts=8 * step, seed=10 + step)
        for key in ("x", "topk_ids", "topk_weights"):
            args[key].copy_(fresh[key])
        graph.replay()
        assert_close(out, reference_moe(args), TOLERANCE[torch.bfloat16])
