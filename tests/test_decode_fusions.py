"""The small-batch decode step's fused launches (issue 33) against the unfused kernels they replace.

* `kernels.rotary_write_kv`: rotary then the KV write, in one launch;
* `kernels.rotary_paged_attention`: those and the decode attention, in one launch;
* the GEMV with SiLU-and-mul in its epilogue (`triton_fp8_gemv.gemv(..., silu_and_mul=True)`),
  chosen by `executor.quantization.gemv_silu_and_mul_applies` for a SwiGLU MLP's gate_up;
* programmatic dependent launch (`kernels.pdl`): on CUDA, a decode step replayed from a CUDA graph
  gives the same logits with and without it.

The fused kernels compute what the unfused ones do, op for op, so the checks are for equality
(under the interpreter and compiled), on fresh random inputs and odd shapes.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor import quantization
from pagedserve.executor.loader import load_model_spec, load_weights
from pagedserve.executor.model import AttentionMetadata, CausalLM
from pagedserve.kernels import fp8, triton_attention, triton_layers
from pagedserve.kernels import triton_fp8_gemv as gemv
from pagedserve.tiny_model import TinyModelSpec, write_tiny_model
from tests.triton_marks import DEVICE, needs_cuda, needs_triton

pytestmark = needs_triton


@pytest.fixture(autouse=True)
def _decode_rotary(monkeypatch):
    """The decode launch that rotates and writes (`PAGEDSERVE_DECODE_ROTARY=1`) in every test here:
    the model-level steps below take it too."""
    monkeypatch.setattr(triton_attention, "DECODE_ROTARY", True)


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0):
    return (scale * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)


# --------------------------------------------------------------------------------------------- #
# Rotary + KV write
# --------------------------------------------------------------------------------------------- #


def _split_heads(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """Head views (q, k, v) of a copy of a fused qkv output, as the model's attention takes them."""
    q, k, v = qkv.clone().split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    return (x.view(qkv.shape[0], -1, head_dim) for x in (q, k, v))


def _tables(max_len: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(max_len).float(), 1.0 / (10000 ** (torch.arange(half).float() / half)))
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize(
    "num_tokens, num_q_heads, num_kv_heads, head_dim",
    [(1, 32, 8, 128), (3, 5, 3, 40), (7, 4, 1, 64)],
)
def test_rotary_write_kv_equals_rotary_then_write(
    cache_dtype, num_tokens, num_q_heads, num_kv_heads, head_dim
):
    """q and k rotated in place and the caches written exactly as the rotary kernel then the KV
    write leave them (padding slots untouched), through strided views of a fused qkv output. (Each
    of those is checked against its torch reference in tests/test_layer_kernels.py and
    tests/test_kernels.py.)"""
    gen = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, gen=gen, dtype=dtype, scale=2.0)
    positions = torch.randint(0, 50, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(4 * 16, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1  # a padding row: written nowhere
    slots = slots.to(DEVICE)
    cos, sin = _tables(64, head_dim // 2)
    scales = (torch.tensor([0.05], device=DEVICE), torch.tensor([0.03], device=DEVICE))
    results = []
    for fused in (False, True):
        q, k, v = _split_heads(qkv, num_q_heads, num_kv_heads, head_dim)
        poison = torch.full((4, 16, num_kv_heads, head_dim), 7.0, device=DEVICE).to(cache_dtype)
        k_cache, v_cache = poison.clone(), poison.clone()
        if fused:
            triton_attention.rotary_write_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots, *scales)
        else:
            triton_layers.rotary_embedding(positions, q, k, cos, sin)
            triton_attention.write_kv(k, v, k_cache, v_cache, slots, *scales)
        results.append((q, k, k_cache, v_cache))
    for unfused, fused in zip(*results, strict=True):
        assert torch.equal(fused.view(torch.uint8), unfused.view(torch.uint8))


def test_rotary_write_kv_dispatch_and_zero_tokens(monkeypatch):
    """The references off Triton; nothing written for an empty step."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (_randn(0, h, 16, gen=gen) for h in (2, 1, 1))
    cache = torch.zeros(2, 16, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    cos, sin = _tables(8, 8)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    from pagedserve import kernels

    for choice in ("reference", "triton"):
        monkeypatch.setenv("PAGEDSERVE_ATTENTION", choice)
        kernels.rotary_write_kv(empty, q, k, v, cos, sin, cache, cache, empty)
    assert not cache.any()


# The decode launch's modes (`triton_attention._decode_plan`), picked through the SM count and the
# table width: (sequences, q heads, KV heads, head_dim, table blocks, SMs, what the plan must be).
_DECODE_MODES = {
    "one tile a split": (2, 8, 2, 64, 16, 132, "SINGLE_TILE"),
    "fitted splits": (2, 4, 1, 32, 520, 132, "FIT_SPLITS"),
    "unsplit": (3, 6, 3, 16, 4, 1, None),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("windowed", [False, True], ids=["plain", "window-cap"])
@pytest.mark.parametrize("mode", list(_DECODE_MODES))
def test_decode_launch_rotates_and_writes_as_rotary_write_kv_then_attention(
    monkeypatch, mode, windowed, dtype
):
    """`rotary_paged_attention` in a decode batch (one launch fewer): the caches bit for bit what
    `rotary_write_kv` writes, the result that of `paged_attention` after it (equal under the
    interpreter; compiled, the fused launch runs without FMA contraction, so within rounding), and
    q and key left unrotated; a padding row (slot -1) writes nothing. With a sliding window (half
    the table) and a soft-cap too, whatever launch the window's span then gets."""
    num_seqs, num_q_heads, num_kv_heads, head_dim, width, sm_count, flag = _DECODE_MODES[mode]
    monkeypatch.setattr(triton_attention, "_sm_count", lambda device: sm_count)
    gen = torch.Generator().manual_seed(width * 10 + head_dim)
    page, max_len = 16, width * 16
    window, soft_cap = (max_len // 2, 30.0) if windowed else (None, None)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    lens[0] = min(max_len, 2 * page + 1)  # its token starts a block
    tables = torch.stack([torch.randperm(num_seqs * width, generator=gen)[:width] for _ in range(num_seqs)])
    slots = tables.gather(1, ((lens - 1) // page)[:, None])[:, 0] * page + (lens - 1) % page
    slots[-1] = -1
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(num_seqs, q_size + 2 * kv_size, gen=gen, dtype=dtype, scale=2.0)
    cache = _randn(num_seqs * width, page, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    cos, sin = _tables(max_len, head_dim // 2)
    args = dict(
        positions=(lens - 1).to(DEVICE), block_tables=tables.to(torch.int32).to(DEVICE),
        slots=slots.to(DEVICE), seq_lens=lens.to(torch.int32).to(DEVICE),
        cu=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    results = []
    for fused in (False, True):
        q, k, v = _split_heads(qkv, num_q_heads, num_kv_heads, head_dim)
        k_cache, v_cache = cache.clone(), cache.flip(0).clone()
        out = triton_attention.rotary_paged_attention(
            args["positions"], q, k, v, cos, sin, k_cache, v_cache, args["slots"], args["block_tables"],
            args["seq_lens"], args["cu"], head_dim**-0.5, decode_only=fused, sliding_window=window,
            soft_cap=soft_cap,
        )  # fmt: skip
        results.append((out, k_cache, v_cache, q, k))
    unfused, fused = results
    if not windowed:
        plan = triton_attention.decode_plan(fused[3], cache, args["block_tables"])
        assert (plan.num_splits > 1) == (flag is not None) and (flag is None or plan.meta[flag])
    assert torch.equal(fused[1], unfused[1]) and torch.equal(fused[2], unfused[2])
    q0, k0, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    assert torch.equal(fused[3].reshape(num_seqs, -1), q0) and torch.equal(fused[4].reshape(num_seqs, -1), k0)
    if DEVICE == "cpu":
        assert torch.equal(fused[0], unfused[0])
    else:
        torch.testing.assert_close(fused[0], unfused[0], atol=2e-2, rtol=2e-2)


def test_decode_launch_rotates_only_where_it_may(monkeypatch):
    """Not in a batch that is not known to be decodes alone, nor over FP8 caches, nor where head
    rows would carry padding columns, nor without `PAGEDSERVE_DECODE_ROTARY=1`."""
    bf16 = torch.bfloat16
    q = torch.empty(2, 4, 64, dtype=bf16)
    seq_lens = torch.ones(2, dtype=torch.int32)
    cache = torch.empty(1, 16, 2, 64, dtype=bf16)
    fuses = triton_attention.fuses_rotary
    assert fuses(q, cache, seq_lens, True)
    assert not fuses(q, cache, seq_lens, False)
    assert not fuses(q, cache.to(torch.float8_e4m3fn), seq_lens, True)
    assert not fuses(q[:, :, :48], cache[..., :48], seq_lens, True)
    assert not fuses(q, cache, torch.ones(3, dtype=torch.int32), True)
    monkeypatch.setattr(triton_attention, "DECODE_ROTARY", False)
    assert not fuses(q, cache, seq_lens, True)


# --------------------------------------------------------------------------------------------- #
# GEMV with SiLU-and-mul
# --------------------------------------------------------------------------------------------- #


def _gate_up(m: int, intermediate: int, k: int, fp8_weights: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = _randn(m, k, gen=gen)
    w = (torch.randn(2 * intermediate, k, generator=gen) / k**0.5).to(torch.bfloat16)
    if fp8_weights:
        wq, ws = fp8.quantize_weight(w)
        return x, wq.to(DEVICE), ws.to(DEVICE)
    return x, w.to(DEVICE), None


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("m, intermediate, k", [(1, 37, 300), (2, 24, 520), (1, 8, 64), (4, 19, 130)])
def test_gemv_silu_and_mul_equals_gemv_then_silu_and_mul(fp8_weights, m, intermediate, k):
    """Bit for bit the projection's output (rounded to bf16) through `silu_and_mul`: the epilogue
    pairs each output's gate and up rows, whatever the block of rows (odd intermediate sizes)."""
    x, w, scale = _gate_up(m, intermediate, k, fp8_weights, seed=m * 1000 + intermediate)
    assert gemv.fuses_silu_and_mul(m, 2 * intermediate, k, w.dtype, x.device)
    unfused = triton_layers.silu_and_mul(gemv.gemv(x, w, scale, None, torch.bfloat16))
    fused = gemv.gemv(x, w, scale, None, torch.bfloat16, silu_and_mul=True)
    assert fused.shape == (m, intermediate)
    assert torch.equal(fused, unfused)


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
@pytest.mark.parametrize(
    "n, k, silu, bias",
    [(37, 300, False, True), (48, 520, True, False), (9, 64, False, False), (40, 130, True, False)],
)
def test_gemv_with_the_norm_equals_norm_then_gemv(fp8_weights, with_residual, n, k, silu, bias):
    """The norm inside the GEMV (`GemvNorm`): the residual stream it stores is bit for bit the norm
    kernel's; the outputs are within the bf16 output's rounding of float32 math, and near the norm
    kernel then the GEMV, which rounds the normalised row twice more (to bf16, then times the
    weight) where the fused kernel keeps float32."""
    _check_norm_in_gemv(fp8_weights, with_residual, n, k, silu, bias)


@needs_cuda
@pytest.mark.parametrize("fp8_weights", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n, silu", [(6144, False), (28672, True), (32000, False)])
def test_cuda_gemv_with_the_norm_on_llama_shapes(fp8_weights, n, silu):
    """The same at the llama-8b shape's qkv, gate_up and (a smaller vocabulary's) LM head."""
    _check_norm_in_gemv(fp8_weights, True, n, 4096, silu, False)


def _check_norm_in_gemv(
    fp8_weights: bool, with_residual: bool, n: int, k: int, silu: bool, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x, residual = _randn(1, k, gen=gen, scale=3.0), _randn(1, k, gen=gen)
    residual = residual if with_residual else None
    norm_weight = (1.0 + 0.3 * torch.randn(k, generator=gen)).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    w, scale = [t.to(DEVICE) for t in fp8.quantize_weight(w)] if fp8_weights else (w.to(DEVICE), None)
    b = _randn(n, gen=gen) if bias else None
    eps = 1e-5
    unfused = triton_layers.rms_norm(x, norm_weight, eps, residual)
    normed, stream = unfused if with_residual else (unfused, x)
    want = gemv.gemv(normed, w, scale, b, torch.bfloat16, silu_and_mul=silu)
    residual_out = torch.empty_like(x) if with_residual else None
    assert gemv.fuses_norm(1, n, k, w.dtype, x.device)
    norm = gemv.GemvNorm(norm_weight, eps, residual, residual_out)
    got = gemv.gemv(x, w, scale, b, torch.bfloat16, silu_and_mul=silu, norm=norm)
    if with_residual:
        assert torch.equal(residual_out, stream)
    assert got.shape == want.shape
    # float32 math: the norm of the (rounded) stream, the widened weights, then the activation
    h = stream.float()
    wide = w.float() if scale is None else w.float() * scale[:, None]
    y = (norm_weight.float() * h * torch.rsqrt(h.pow(2).mean() + eps)) @ wide.t()
    y = y if b is None else y + b.float()
    if silu:
        y = y.to(torch.bfloat16).float()
        y = torch.nn.functional.silu(y[:, : n // 2]) * y[:, n // 2 :]
    assert (got.float() - y).abs().amax() <= 2**-5 * y.abs().amax()  # a few bf16 ulps (SiLU: rounded thrice)
    assert (got.float() - want.float()).abs().amax() <= 2**-4 * y.abs().amax()  # two roundings more


def test_the_norm_needs_one_row_and_whole_sums():
    """A configuration that splits K, or more than one row, cannot take the norm."""
    device, bf16 = torch.device(DEVICE), torch.bfloat16
    split = gemv.SplitKGemvConfig(block_n=8, block_k=64, split_k=4)
    assert not gemv.fuses_norm(1, 64, 1024, bf16, device, split)
    assert gemv.fuses_norm(1, 64, 1024, bf16, device, gemv.SplitKGemvConfig(8, 64, split_k=1))
    assert not gemv.fuses_norm(2, 64, 1024, bf16, device, gemv.SplitKGemvConfig(8, 64, split_k=1))


def test_silu_and_mul_needs_whole_sums():
    """A configuration that splits K cannot apply the activation in its epilogue."""
    device, bf16 = torch.device(DEVICE), torch.bfloat16
    split = gemv.SplitKGemvConfig(block_n=8, block_k=64, split_k=4)
    assert not gemv.fuses_silu_and_mul(1, 64, 1024, bf16, device, split)
    assert gemv.fuses_silu_and_mul(1, 64, 1024, bf16, device, gemv.SplitKGemvConfig(8, 64, split_k=1))
    assert not gemv.fuses_silu_and_mul(1, 63, 1024, bf16, device)  # odd N
    assert not gemv.fuses_silu_and_mul(gemv.GEMV_MAX_M + 1, 64, 1024, bf16, device)


def test_dispatch_by_token_count(monkeypatch):
    """The fused GEMV where the projection alone would run on the GEMV kernel: bf16 at
    BF16_GEMV_MAX_M rows, FP8 weight-only up to FP8_GEMV_MAX_M rows; never off Triton."""
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "triton")
    gen = torch.Generator().manual_seed(4)
    w16 = _randn(64, 256, gen=gen)
    w8, _ = fp8.quantize_weight(w16.cpu())
    w8 = w8.to(DEVICE)
    applies = quantization.gemv_silu_and_mul_applies
    rows = lambda m: _randn(m, 256, gen=gen)  # noqa: E731
    assert [applies(rows(m), w16) for m in (1, 2)] == [True, quantization.bf16_gemv_max_m() >= 2]
    fp8_rows = [applies(rows(m), w8) for m in range(1, 5)]
    assert fp8_rows == [m <= gemv.FP8_GEMV_MAX_M for m in range(1, 5)]
    assert not applies(fp8.quantize_per_token(rows(1)), w8)  # quantized activations: _scaled_mm
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "reference")
    assert not applies(rows(1), w16)


# --------------------------------------------------------------------------------------------- #
# A decode step through the model
# --------------------------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=64, intermediate_size=144, num_attention_heads=4, num_key_value_heads=2)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-fusions"), spec)


def _decode_inputs(model_dir, quant: str | None, num_seqs: int):
    """A bf16 model and one decode token per sequence (contexts of 5, 9, ... tokens, their earlier
    KV random): (model, input ids, metadata, caches)."""
    spec = load_model_spec(model_dir)
    model = CausalLM(spec, 64, torch.device(DEVICE), torch.bfloat16, quantization=quant)
    load_weights(model, spec, model_dir)
    gen = torch.Generator().manual_seed(11)
    cache_shape = (2 * num_seqs, 16, spec.num_kv_heads, spec.head_dim)
    caches = [(_randn(*cache_shape, gen=gen), _randn(*cache_shape, gen=gen)) for _ in range(spec.num_layers)]
    lens = [5 + 4 * i for i in range(num_seqs)]
    tables = [[2 * i, 2 * i + 1] for i in range(num_seqs)]
    meta = AttentionMetadata(
        positions=torch.tensor([n - 1 for n in lens], device=DEVICE),
        slot_mapping=torch.tensor([[2 * i * 16 + n - 1 for i, n in enumerate(lens)]], device=DEVICE),
        block_tables=torch.tensor([tables], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE),
        decode_only=True,
    )
    ids = torch.randint(3, spec.vocab_size, (num_seqs,), generator=gen).to(DEVICE)
    return model, ids, meta, caches


def _decode_step(model_dir, quant: str | None, num_seqs: int) -> torch.Tensor:
    model, ids, meta, caches = _decode_inputs(model_dir, quant, num_seqs)
    return model(ids, meta, caches, None)


@pytest.mark.parametrize("quant, num_seqs", [(None, 1), ("fp8", 1), ("fp8", 2)], ids=str)
def test_decode_step_on_the_fused_kernels_matches_reference(monkeypatch, tiny_dir, quant, num_seqs):
    """A decode step through the fused launches (counted) agrees with the references' step. At one
    token every norm runs inside the GEMV after it: both of each layer's and the final one."""
    if quant == "fp8":
        monkeypatch.setenv(quantization.REFERENCE_ENV, "1")
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "reference")
    expected = _decode_step(tiny_dir, quant, num_seqs)
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "triton")
    calls = []
    real = gemv.gemv

    def recording(*args, **kwargs):
        calls.append((kwargs.get("silu_and_mul", False), kwargs.get("norm") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(gemv, "gemv", recording)
    rotary_launches = []
    monkeypatch.setattr(triton_attention, "rotary_write_kv", lambda *args: rotary_launches.append(args))
    actual = _decode_step(tiny_dir, quant, num_seqs)
    assert not rotary_launches, "the decode launch did not rotate (head_dim 16)"
    assert (True, num_seqs == 1) in calls, "gate_up did not take the fused GEMV"
    num_layers = load_model_spec(tiny_dir).num_layers
    assert sum(norm for _, norm in calls) == (2 * num_layers + 1 if num_seqs == 1 else 0)
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=5e-2)


@needs_cuda
@pytest.mark.parametrize("quant", [None, "fp8"], ids=str)
def test_cuda_graph_step_with_and_without_pdl(monkeypatch, tiny_dir, quant):
    """Programmatic dependent launch changes when kernels start, not what they compute: a decode
    step captured in a CUDA graph with it gives bit-identical logits to one captured without,
    replayed back to back (each replay's kernels overlap the previous one's tail)."""
    from pagedserve.kernels import pdl

    model, ids, meta, caches = _decode_inputs(tiny_dir, quant, 1)
    pristine = [(k.clone(), v.clone()) for k, v in caches]
    results = {}
    for on in ("0", "1"):
        monkeypatch.setenv(pdl.PDL_ENV, on)
        model(ids, meta, caches, None)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(ids, meta, caches, None)
        for (k, v), (k0, v0) in zip(caches, pristine, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        results[on] = (logits.clone(), [k.clone() for k, _ in caches])
    assert pdl.pdl_enabled(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
    assert torch.equal(results["0"][0], results["1"][0])
    assert all(torch.equal(a, b) for a, b in zip(results["0"][1], results["1"][1], strict=True))
