"""The FP8 weight-only kernel for small M and the executor's choice of it by the step's token count.

Kernel against the plain-torch reference (widen the e4m3 weights, multiply in float32, scale per
output channel) on fresh random inputs and odd shapes: under the interpreter on the CPU (tiny
shapes), compiled on CUDA (llama-8b-size rows, inside a CUDA graph too). The dispatch tests run
the references on the CPU and record which product each Fp8Linear call took.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor import quantization
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.quantization import Fp8Linear
from pagedserve.executor.runner import ModelRunner
from pagedserve.kernels import fp8
from pagedserve.tiny_model import TinyModelSpec, write_tiny_model
from tests.triton_marks import DEVICE, INTERPRETED, needs_cuda, needs_triton


def _operands(m: int, n: int, k: int, seed: int, bias: bool = True, device: str = DEVICE):
    """bf16 activations, e4m3 weights with per-row scales (from random bf16, rows of different
    magnitudes, as `quantize_weight` makes them), an optional bf16 bias."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]
    wq, ws = fp8.quantize_weight(w.to(torch.bfloat16))
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), move(wq), move(ws), move(b)


def _assert_close_to_reference(got: torch.Tensor, x, wq, ws, b) -> None:
    """Equal to the float32 reference but for the bf16 output's rounding (half an ulp; a whole one
    under the interpreter, which truncates) and the order of the float32 sums."""
    want = fp8.weight_only_linear_reference(x, wq, ws, b, torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.float() - want).abs()
    bound = want.abs() * (2**-7 if INTERPRETED else 2**-8) + 1e-5 * want.abs().amax()
    assert (err <= bound).all(), f"max error {err.max().item():.3g} (worst bound {bound.min().item():.3g})"


# --------------------------------------------------------------------------------------------- #
# The kernel (interpreted off the GPU: tiny shapes)
# --------------------------------------------------------------------------------------------- #


@needs_triton
@pytest.mark.parametrize(
    "m, n, k",
    [(1, 37, 300), (2, 19, 520), (4, 24, 1100), (5, 33, 129), (13, 70, 513), (17, 40, 200), (64, 17, 96)],
)
def test_weight_only_kernel_matches_reference_on_odd_shapes(m, n, k):
    """The tables' configuration for each M (the GEMV kernel up to 4 rows, tensor cores above),
    K and N not multiples of any tile, a bias; split-K wherever N gives too few programs."""
    from pagedserve.kernels import triton_fp8_gemv as gemv

    x, wq, ws, b = _operands(m, n, k, seed=m * 1000 + n)
    _assert_close_to_reference(gemv.weight_only_linear(x, wq, ws, b, torch.bfloat16), x, wq, ws, b)


@needs_triton
@pytest.mark.parametrize(
    "config",
    [
        dict(block_m=16, block_n=16, block_k=32, use_dot=True, split_k=3),  # split-K, tensor cores
        dict(block_m=2, block_n=8, block_k=64, use_dot=False, split_k=1),  # one split, M tiled
        dict(block_m=1, block_n=32, block_k=16, use_dot=False, split_k=64),  # more splits than K steps
    ],
)
def test_weight_only_kernel_launch_variants(config):
    from pagedserve.kernels import triton_fp8_gemv as gemv

    x, wq, ws, b = _operands(5, 45, 150, seed=7, bias=config["split_k"] != 3)
    got = gemv.weight_only_linear(x, wq, ws, b, torch.bfloat16, gemv.GemvConfig(**config))
    _assert_close_to_reference(got, x, wq, ws, b)


@needs_triton
def test_weight_only_kernel_edge_shapes():
    from pagedserve.kernels import triton_fp8_gemv as gemv

    x, wq, ws, b = _operands(3, 24, 64, seed=3)
    assert gemv.weight_only_linear(x[:0], wq, ws, b, torch.bfloat16).shape == (0, 24)
    strided = torch.zeros(3, 100, dtype=torch.bfloat16, device=x.device)
    strided[:, :64] = x  # rows contiguous, row stride 100
    _assert_close_to_reference(
        gemv.weight_only_linear(strided[:, :64], wq, ws, None, torch.bfloat16), x, wq, ws, None
    )


def _bf16_operands(m: int, n: int, k: int, seed: int, bias: bool = True, device: str = DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    return x.to(device), w.to(device), None if b is None else b.to(device)


def _assert_close_to_dense(got: torch.Tensor, x, w, b) -> None:
    """As `_assert_close_to_reference`, for 16-bit weights (no scale)."""
    want = x.float() @ w.float().t() + (0 if b is None else b.float())
    assert got.dtype == x.dtype and got.shape == want.shape
    err = (got.float() - want).abs()
    bound = want.abs() * (2**-7 if INTERPRETED else 2**-8) + 1e-5 * want.abs().amax()
    assert (err <= bound).all(), f"max error {err.max().item():.3g} (worst bound {bound.min().item():.3g})"


# Small GEMV configurations for the interpreter: split-K (auto and fixed), each accumulator, the
# loop pipelined or not; tiles that divide none of the shapes below.
_GEMV_CONFIGS = [
    None,  # the default table's
    dict(block_n=8, block_k=64, split_k=3, num_stages=3, acc_2d=False),
    dict(block_n=4, block_k=32, split_k=1, num_stages=1, acc_2d=True),
    dict(block_n=16, block_k=16, split_k=None, num_warps=2, num_stages=2),
]


@needs_triton
@pytest.mark.parametrize("config", _GEMV_CONFIGS, ids=["table", "split3-1d", "nosplit-2d", "auto"])
@pytest.mark.parametrize("m, n, k", [(1, 37, 300), (2, 19, 520), (3, 24, 1100), (4, 33, 129), (1, 9, 64)])
def test_gemv_kernel_fp8_matches_reference_on_odd_shapes(m, n, k, config):
    """The GEMV kernel (M <= 4) on e4m3 weights: K and N not multiples of any tile (but (1, 9, 64):
    K whole steps, no masks in the loop), a bias."""
    from pagedserve.kernels import triton_fp8_gemv as gemv

    x, wq, ws, b = _operands(m, n, k, seed=m * 100 + n)
    cfg = config and gemv.SplitKGemvConfig(**config)
    _assert_close_to_reference(gemv.gemv(x, wq, ws, b, torch.bfloat16, cfg), x, wq, ws, b)


@needs_triton
@pytest.mark.parametrize("config", _GEMV_CONFIGS, ids=["table", "split3-1d", "nosplit-2d", "auto"])
@pytest.mark.parametrize("m, n, k", [(1, 37, 300), (2, 19, 520), (3, 24, 1100), (4, 33, 129)])
def test_gemv_kernel_bf16_matches_reference_on_odd_shapes(m, n, k, config):
    """The same kernel on bf16 weights (no scale), bias on odd M."""
    from pagedserve.kernels import triton_fp8_gemv as gemv

    x, w, b = _bf16_operands(m, n, k, seed=m * 100 + n, bias=m % 2 == 1)
    cfg = config and gemv.SplitKGemvConfig(**config)
    _assert_close_to_dense(gemv.gemv(x, w, None, b, torch.bfloat16, cfg), x, w, b)


@needs_triton
def test_weight_only_linear_takes_the_gemv_at_few_rows(monkeypatch):
    """weight_only_linear: the GEMV kernel for M <= FP8_GEMV_MAX_M (or given a GEMV
    configuration), the tiled kernel above (or given a tiled configuration)."""
    from pagedserve.kernels import triton_fp8_gemv as gemv

    taken = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: taken.append("gemv") or real(*a, **kw))
    x, wq, ws, b = _operands(5, 20, 70, seed=21)
    assert gemv.FP8_GEMV_MAX_M == 2
    for m in (1, 2, 3, 5):
        _assert_close_to_reference(
            gemv.weight_only_linear(x[:m], wq, ws, b, torch.bfloat16), x[:m], wq, ws, b
        )
    assert taken == ["gemv", "gemv"]
    gemv.weight_only_linear(x[:4], wq, ws, b, torch.bfloat16, gemv.SplitKGemvConfig(8, 64))
    assert taken == ["gemv", "gemv", "gemv"]
    gemv.weight_only_linear(x[:1], wq, ws, b, torch.bfloat16, gemv.GemvConfig(16, 16, 32, True))
    assert taken == ["gemv", "gemv", "gemv"]


def test_gemv_tables_and_split():
    from pagedserve.kernels import triton_fp8_gemv as gemv

    cpu = torch.device("cpu")  # planned for 132 SMs
    fp8_one = gemv.gemv_config_for(1, 1000, 1000, fp8.FP8_DTYPE)  # a shape off the table
    bf16_one = gemv.gemv_config_for(1, 1000, 1000, torch.bfloat16)
    # the same bytes per step: 16 e4m3 or 8 bf16 elements per 16-byte load
    assert fp8_one.block_k == 2 * bf16_one.block_k
    assert gemv.gemv_config_for(3, 10, 10, torch.bfloat16) == gemv.GEMV_DEFAULTS[("16bit", 4)]
    assert gemv.gemv_config_for(3, 4096, 4096, torch.bfloat16) == gemv.GEMV_TABLE[("16bit", 4, 4096, 4096)]
    for kind, m, _, _ in gemv.GEMV_TABLE:  # FP8 at 3-4 rows takes the tiled kernel: no entries
        assert kind == "16bit" or m <= gemv.FP8_GEMV_MAX_M
    # every llama-8b shape has >= 2 programs per SM without a split; a small shard gets one
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        for m in (1, 2, 4):
            config = gemv.gemv_config_for(m, n, k, fp8.FP8_DTYPE)
            if config.split_k is None:
                assert gemv._gemv_split_k(config, n, k, cpu) == 1
    auto = gemv.SplitKGemvConfig(block_n=8, block_k=512)
    assert gemv._gemv_split_k(auto, 512, 4096, cpu) == 2  # 64 programs: 264 wanted, 8 steps / 4
    assert gemv._gemv_split_k(auto, 512, 14336, cpu) == 5  # 28 steps allow 7
    assert gemv._gemv_split_k(gemv.SplitKGemvConfig(8, 512, split_k=64), 8, 1000, cpu) == 2
    with pytest.raises(ValueError, match="power of two"):
        gemv.SplitKGemvConfig(block_n=12, block_k=64)
    with pytest.raises(ValueError, match="num_stages"):
        gemv.SplitKGemvConfig(block_n=8, block_k=64, num_stages=0)


def test_split_k_fills_the_device_and_keeps_loops_long():
    from pagedserve.kernels import triton_fp8_gemv as gemv

    cpu = torch.device("cpu")  # planned for 132 SMs
    one = gemv.config_for(1)
    assert one.block_n == 64 and one.use_dot
    # o_proj at M=1: 64 tiles of 64 rows, 9 splits wanted, but K=4096 has 16 steps of 256: 4
    assert gemv._split_k(one, 1, 4096, 4096, cpu) == 4
    assert gemv._split_k(one, 1, 4096, 14336, cpu) == 9  # down_proj: 56 steps, 9 splits fill it
    # the LM head has 2004 tiles already: no split
    assert gemv._split_k(one, 1, 128256, 4096, cpu) == 1
    # a short K is never cut below 4 steps of block_k
    assert gemv._split_k(gemv.config_for(64), 64, 64, 1024, cpu) == 2
    assert gemv._split_k(gemv.GemvConfig(1, 16, 512, False, split_k=8), 1, 16, 1024, cpu) == 2
    assert [gemv.config_for(m).block_m for m in (1, 2, 3, 4, 8, 16, 17, 32, 64, 100)] == [
        16, 16, 16, 16, 16, 16, 32, 32, 64, 64,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        gemv.GemvConfig(1, 24, 64, False)
    with pytest.raises(ValueError, match=">= 16"):
        gemv.GemvConfig(8, 64, 64, True)


def test_reference_is_the_widened_product():
    x, wq, ws, b = _operands(4, 12, 40, seed=5, device="cpu")
    got = fp8.weight_only_linear(x.float(), wq, ws, b, torch.float32)  # CPU tensors: the reference
    want = x.float() @ (wq.float() * ws[:, None]).t() + b.float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- #
# The executor's choice by M
# --------------------------------------------------------------------------------------------- #


@pytest.fixture
def threshold():
    """Sets the weight-only threshold for one test and restores it."""
    before = quantization.weight_only_max_m()
    yield quantization.set_weight_only_max_m
    quantization.set_weight_only_max_m(before)


def test_bf16_gemv_threshold_env_var(monkeypatch):
    monkeypatch.delenv(quantization.BF16_GEMV_MAX_M_ENV, raising=False)
    assert quantization.BF16_GEMV_MAX_M == 1
    assert quantization._read_bf16_gemv_max_m() == 1
    monkeypatch.setenv(quantization.BF16_GEMV_MAX_M_ENV, "0")
    assert quantization._read_bf16_gemv_max_m() == 0
    monkeypatch.setenv(quantization.BF16_GEMV_MAX_M_ENV, "4")
    assert quantization._read_bf16_gemv_max_m() == 4
    for bad in ("-2", "x"):
        monkeypatch.setenv(quantization.BF16_GEMV_MAX_M_ENV, bad)
        with pytest.raises(ValueError, match=quantization.BF16_GEMV_MAX_M_ENV):
            quantization._read_bf16_gemv_max_m()


def test_gemv_max_m_mirror():
    pytest.importorskip("triton")
    from pagedserve.kernels import triton_fp8_gemv as gemv

    assert quantization._GEMV_MAX_M == gemv.GEMV_MAX_M


@pytest.fixture
def bf16_threshold():
    before = quantization.bf16_gemv_max_m()
    yield quantization.set_bf16_gemv_max_m
    quantization.set_bf16_gemv_max_m(before)


def test_dense_matmul_dispatches_by_m(monkeypatch, bf16_threshold):
    """The model-dtype projections: the GEMV kernel at M <= the threshold (and <= 4) for 16-bit
    weights where Triton runs, F.linear otherwise (threshold 0, float32, CPU tensors)."""
    from pagedserve.kernels import triton_fp8_gemv as gemv

    taken = []
    monkeypatch.setattr(gemv, "linear_16bit", lambda x, w, b=None: taken.append(x.shape[0]) or "gemv")
    x, w, b = _bf16_operands(6, 12, 40, seed=4, device="cpu")
    dense = quantization.dense_matmul
    bf16_threshold(0)
    torch.testing.assert_close(dense(x[:1], w, b), torch.nn.functional.linear(x[:1], w, b))
    assert taken == []
    bf16_threshold(8)
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "triton")  # CPU tensors take Triton (interpreter)
    assert dense(x[:1], w, b) == "gemv" and dense(x[:4], w) == "gemv"
    assert taken == [1, 4]
    assert isinstance(dense(x[:5], w, b), torch.Tensor)  # above the kernel's 4 rows: cuBLAS
    assert isinstance(dense(x[:2].float(), w.float()), torch.Tensor)  # float32: F.linear
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "reference")
    assert isinstance(dense(x[:2], w), torch.Tensor)
    assert taken == [1, 4]


def test_threshold_env_var(monkeypatch):
    monkeypatch.delenv(quantization.WEIGHT_ONLY_MAX_M_ENV, raising=False)
    assert quantization._read_weight_only_max_m() == quantization.WEIGHT_ONLY_MAX_M
    monkeypatch.setenv(quantization.WEIGHT_ONLY_MAX_M_ENV, "48")
    assert quantization._read_weight_only_max_m() == 48
    monkeypatch.setenv(quantization.WEIGHT_ONLY_MAX_M_ENV, "0")
    assert quantization._read_weight_only_max_m() == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv(quantization.WEIGHT_ONLY_MAX_M_ENV, bad)
        with pytest.raises(ValueError, match=quantization.WEIGHT_ONLY_MAX_M_ENV):
            quantization._read_weight_only_max_m()


def _recording(monkeypatch) -> list[str]:
    """Which FP8 product each call took ("weight_only" or "scaled_mm"), in order."""
    calls: list[str] = []
    weight_only, scaled = fp8.weight_only_linear, fp8.fp8_linear

    def record_weight_only(x, *args, **kwargs):
        assert not isinstance(x, fp8.QuantizedActivation)
        calls.append("weight_only")
        return weight_only(x, *args, **kwargs)

    def record_scaled(x, *args, **kwargs):
        assert isinstance(x, fp8.QuantizedActivation)
        calls.append("scaled_mm")
        return scaled(x, *args, **kwargs)

    monkeypatch.setattr(fp8, "weight_only_linear", record_weight_only)
    monkeypatch.setattr(fp8, "fp8_linear", record_scaled)
    return calls


def test_fp8_linear_dispatches_by_m(monkeypatch, threshold):
    threshold(4)
    calls = _recording(monkeypatch)
    layer = Fp8Linear(12, 40, True, torch.device("cpu"), torch.float32)
    x, wq, ws, b = _operands(6, 12, 40, seed=9, device="cpu")
    layer.weight.data.copy_(wq)
    layer.weight_scale.data.copy_(ws)
    layer.bias.data.copy_(b.float())
    x = x.float()
    small, large = layer(x[:4]), layer(x)
    assert calls == ["weight_only", "scaled_mm"]
    torch.testing.assert_close(small, fp8.weight_only_linear_reference(x[:4], wq, ws, b, torch.float32))
    layer(fp8.quantize_per_token(x[:1]))  # already quantized: _scaled_mm whatever M
    assert calls[-1] == "scaled_mm"
    threshold(0)  # off
    layer(x[:1])
    assert calls[-1] == "scaled_mm"
    assert small.shape == (4, 12) and large.shape == (6, 12)


def test_norm_and_activation_before_fp8_hand_over_by_m(threshold):
    threshold(3)
    x, weight = torch.randn(5, 32), torch.rand(32) + 0.5
    assert isinstance(quantization.rms_norm_for_fp8(x, weight, 1e-5), fp8.QuantizedActivation)
    small = quantization.rms_norm_for_fp8(x[:3], weight, 1e-5)
    assert isinstance(small, torch.Tensor) and small.dtype == torch.float32
    normed, residual = quantization.rms_norm_for_fp8(x[:3], weight, 1e-5, torch.ones(3, 32))
    assert isinstance(normed, torch.Tensor) and residual.shape == (3, 32)
    assert isinstance(quantization.silu_and_mul_for_fp8(torch.randn(3, 64)), torch.Tensor)
    assert isinstance(quantization.silu_and_mul_for_fp8(torch.randn(4, 64)), fp8.QuantizedActivation)


def test_fp8_model_decodes_weight_only_and_prefills_with_scaled_mm(tiny_model_dir, monkeypatch, threshold):
    """The tiny model through the runner (references on the CPU): prompt chunks above the threshold
    take `_scaled_mm`, decode steps the weight-only product, and with the weight-only path the
    logits of a short step are closer to float32's (no activation quantization) and within the
    FP8 tolerance of `test_fp8.test_fp8_prompt_logits_close_to_full_precision`."""
    from pagedserve.executor.step_inputs import build_step_inputs

    monkeypatch.setenv("PAGEDSERVE_FP8_REFERENCE", "1")
    model_dir = tiny_model_dir
    base = dict(
        model=str(model_dir), device="cpu", num_gpu_blocks_override=8, max_model_len=128, swap_space=0.001
    )
    runners = {q: ModelRunner.create(ExecutorConfig(**base, quantization=q)) for q in (None, "fp8")}
    prompt = list(range(3, 15))  # 12 tokens
    logits = {}
    calls = _recording(monkeypatch)
    for name, quant, max_m in (("full", None, 0), ("scaled", "fp8", 0), ("weight_only", "fp8", 16)):
        threshold(max_m)
        calls.clear()
        inputs = build_step_inputs([prompt], [0], [[0]], [True], 16, torch.device("cpu"))
        runner = runners[quant]
        logits[name] = runner.model(inputs.input_ids, inputs.meta, runner.kv_cache.layer_caches(), None)
        per_layer = 4 * runner.model.spec.num_layers
        if quant:
            assert calls == [name if name == "weight_only" else "scaled_mm"] * per_layer
    full = logits["full"]
    rel = {k: ((logits[k] - full).norm() / full.norm()).item() for k in ("scaled", "weight_only")}
    print(f"prompt logits vs float32: relative error {rel}")
    assert rel["weight_only"] < rel["scaled"] < 0.15


def test_fp8_greedy_run_takes_both_paths(tiny_model_dir, monkeypatch, threshold):
    """Chunked prefill of 9 tokens per step and decodes of two sequences at a threshold of 4:
    both products run, every token comes out (agreement with float32 is `test_fp8`'s business)."""
    from tests.test_fp8 import _greedy

    threshold(4)
    monkeypatch.setenv("PAGEDSERVE_FP8_REFERENCE", "1")
    calls = _recording(monkeypatch)
    model_dir = tiny_model_dir
    base = dict(
        model=str(model_dir), device="cpu", num_gpu_blocks_override=32, max_model_len=128, swap_space=0.001
    )
    runner = ModelRunner.create(ExecutorConfig(**base, quantization="fp8"))
    got = _greedy(runner, {1: list(range(3, 24)), 2: list(range(40, 75, 2))}, 4)
    assert all(len(tokens) == 4 for tokens in got.values())
    assert {"weight_only", "scaled_mm"} <= set(calls)


# --------------------------------------------------------------------------------------------- #
# CUDA only: compiled kernel at llama-8b row sizes, and inside a CUDA graph
# --------------------------------------------------------------------------------------------- #


@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16, 17, 31, 32, 48, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (1000, 4100), (4099, 1032)])
def test_cuda_weight_only_kernel_matches_reference(m, n, k):
    from pagedserve.kernels import triton_fp8_gemv as gemv

    x, wq, ws, b = _operands(m, n, k, seed=m + n + k, bias=m % 2 == 1, device="cuda")
    _assert_close_to_reference(gemv.weight_only_linear(x, wq, ws, b, torch.bfloat16), x, wq, ws, b)


@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (1000, 4100), (4099, 1032), (37, 300)])
@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_cuda_gemv_kernel_matches_reference(m, n, k, weights):
    """The GEMV kernel compiled, with the table's configuration for each shape (llama-8b rows,
    odd ones where the loop masks K and the last block of N reads past it)."""
    from pagedserve.kernels import triton_fp8_gemv as gemv

    if weights == "fp8":
        x, wq, ws, b = _operands(m, n, k, seed=m + n + k, bias=m % 2 == 1, device="cuda")
        _assert_close_to_reference(gemv.gemv(x, wq, ws, b, torch.bfloat16), x, wq, ws, b)
    else:
        x, w, b = _bf16_operands(m, n, k, seed=m + n + k, bias=m % 2 == 1, device="cuda")
        _assert_close_to_dense(gemv.linear_16bit(x, w, b), x, w, b)


@needs_cuda
@pytest.mark.parametrize(
    "config",
    [
        dict(block_n=8, block_k=512, split_k=4, num_stages=4),
        dict(block_n=16, block_k=256, split_k=None, num_stages=3, acc_2d=False),
        dict(block_n=4, block_k=1024, split_k=1, num_stages=1),
    ],
)
def test_cuda_gemv_kernel_configs(config):
    from pagedserve.kernels import triton_fp8_gemv as gemv

    x, wq, ws, b = _operands(3, 4099, 4100, seed=5, device="cuda")
    cfg = gemv.SplitKGemvConfig(**config)
    _assert_close_to_reference(gemv.gemv(x, wq, ws, b, torch.bfloat16, cfg), x, wq, ws, b)


@needs_cuda
@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_cuda_gemv_in_a_cuda_graph_is_deterministic(weights):
    """Captured (a split-K configuration: its workspace from the graph's pool), replayed on new
    inputs, and bitwise equal across replays and to the eager call (no atomics)."""
    from pagedserve.kernels import triton_fp8_gemv as gemv

    cfg = gemv.SplitKGemvConfig(block_n=8, block_k=256, split_k=4)
    if weights == "fp8":
        x, wq, ws, _ = _operands(1, 4096, 4096, seed=12, bias=False, device="cuda")
        run = lambda: gemv.gemv(x, wq, ws, None, torch.bfloat16, cfg)  # noqa: E731
    else:
        x, w, _ = _bf16_operands(1, 4096, 4096, seed=12, bias=False, device="cuda")
        run = lambda: gemv.gemv(x, w, None, None, torch.bfloat16, cfg)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    first = out.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(first, out) and torch.equal(out, run())
    if weights == "fp8":
        _assert_close_to_reference(out, x, wq, ws, None)
    else:
        _assert_close_to_dense(out, x, w, None)


@needs_cuda
def test_cuda_weight_only_kernel_in_a_cuda_graph():
    """Warmed up once, captured, replayed on new inputs in the same buffers: the split-K workspace
    comes from the graph's pool and nothing syncs during capture."""
    from pagedserve.kernels import triton_fp8_gemv as gemv

    x, wq, ws, _ = _operands(4, 4096, 4096, seed=11, bias=False, device="cuda")
    gemv.weight_only_linear(x, wq, ws, None, torch.bfloat16)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.weight_only_linear(x, wq, ws, None, torch.bfloat16)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close_to_reference(out, x, wq, ws, None)


@needs_cuda
def test_cuda_fp8_greedy_with_and_without_weight_only(tmp_path, threshold):
    """The compiled path end to end (decode graphs captured with each path): greedy tokens with
    the weight-only path against `_scaled_mm` throughout, agreement printed, not required."""
    from tests.test_fp8 import _agreement, _greedy

    model_dir = write_tiny_model(tmp_path / "m", TinyModelSpec())
    prompts = {1: list(range(3, 24)), 2: list(range(40, 75, 2)), 3: list(range(100, 180, 3))}
    base = dict(
        model=str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks_override=64, max_model_len=256
    )
    tokens = {}
    for max_m in (0, 64):
        threshold(max_m)
        runner = ModelRunner.create(ExecutorConfig(**base, quantization="fp8"))
        tokens[max_m] = _greedy(runner, prompts, 16)
        assert runner.stats.graph_steps > 0
    print(f"CUDA greedy agreement weight-only vs scaled_mm: {_agreement(tokens[64], tokens[0]):.2f}")
