"""Fused layer kernels (RMSNorm, rotary, SiLU-and-mul) against their plain-torch references.

Off the GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before Triton is imported). The interpreter truncates float32 -> bfloat16 casts
where the GPU rounds to nearest even, so bf16 is compared within two ulps there; compiled on CUDA,
16-bit results must also agree bit for bit with torch on nearly every element. Every check draws
fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.executor.loader import load_model_spec, load_weights
from pagedserve.executor.model import AttentionMetadata, CausalLM
from pagedserve.kernels import layers
from pagedserve.kernels import triton_layers as tlay
from pagedserve.tiny_model import TinyModelSpec, write_tiny_model
from tests.triton_marks import DEVICE, HAS_CUDA, INTERPRETED, needs_cuda, needs_triton

pytestmark = needs_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative tolerance: two ulps of the dtype (one for torch vs GPU rounding, one for the interpreter's
# truncating bf16 cast); float32 differs only by the RMSNorm summation order and the GPU's exp/rsqrt.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within two ulps everywhere; compiled on CUDA, 16-bit results also bit-identical on >= 99%."""
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    rtol = RTOL[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * 1e-2)
    # In float32 a different summation order alone moves whole rows by an ulp; rounding to 16 bits
    # hides that, so there the results must be bit-identical nearly everywhere.
    if not INTERPRETED and actual.dtype != torch.float32 and actual.numel() > 0:
        assert (actual == expected).float().mean() >= 0.99, "Triton rounds differently from torch"


# --------------------------------------------------------------------------------------------- #
# RMSNorm
# --------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [80, 96, 200])
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(dtype, hidden, num_tokens, with_residual):
    gen = torch.Generator().manual_seed(hidden * 100 + num_tokens)
    x = _randn(num_tokens, hidden, dtype=dtype, gen=gen, scale=3.0)
    weight = _randn(hidden, dtype=dtype, gen=gen) + 1
    residual = _randn(num_tokens, hidden, dtype=dtype, gen=gen) if with_residual else None
    x_before = x.clone()
    if with_residual:
        actual, summed = tlay.rms_norm(x, weight, 1e-5, residual)
        assert_matches(summed, x + residual)
        # Normalising the kernel's own sum keeps a one-ulp difference in it from compounding.
        expected = layers.rms_norm_reference(summed, weight, 1e-5)
    else:
        actual = tlay.rms_norm(x, weight, 1e-5)
        expected = layers.rms_norm_reference(x, weight, 1e-5)
    assert_matches(actual, expected)
    assert torch.equal(x, x_before), "inputs must not be modified"


def test_rms_norm_strided_rows_and_zero_tokens():
    gen = torch.Generator().manual_seed(1)
    wide = _randn(5, 160, dtype=torch.bfloat16, gen=gen)
    x, residual = wide[:, :96], wide[:, 64:]  # row stride 160, overlapping views
    weight = _randn(96, dtype=torch.bfloat16, gen=gen)
    actual, summed = tlay.rms_norm(x, weight, 1e-6, residual)
    assert_matches(summed, x + residual)
    assert_matches(actual, layers.rms_norm_reference(summed, weight, 1e-6))
    empty = torch.empty((0, 96), dtype=torch.bfloat16, device=DEVICE)
    assert tlay.rms_norm(empty, weight, 1e-6).shape == (0, 96)
    out, out_sum = tlay.rms_norm(empty, weight, 1e-6, empty)
    assert out.shape == out_sum.shape == (0, 96)


# --------------------------------------------------------------------------------------------- #
# Rotary embedding
# --------------------------------------------------------------------------------------------- #


def _split(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    """q, k, v as the model makes them: views of one fused projection output, rows not contiguous."""
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    return [t.view(-1, t.shape[1] // head_dim, head_dim) for t in qkv.split(sizes, dim=-1)]


def _qkv(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype, gen) -> torch.Tensor:
    return _randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)


def _tables(max_len: int, head_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.rand((max_len, head_dim // 2), generator=gen) * 100
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "head_dim, num_q_heads, num_kv_heads",
    [(64, 4, 4), (80, 10, 2), (96, 6, 1), (128, 8, 2), (256, 3, 1)],
    ids=["d64-mha", "d80-gqa", "d96-mqa", "d128-gqa", "d256-odd-heads"],
)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_rotary_matches_reference_in_place(dtype, head_dim, num_q_heads, num_kv_heads, num_tokens):
    gen = torch.Generator().manual_seed(head_dim + num_tokens)
    qkv = _qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, gen)
    expected_qkv = qkv.clone()
    q, k, v = _split(qkv, num_q_heads, num_kv_heads, head_dim)
    eq, ek, _ = _split(expected_qkv, num_q_heads, num_kv_heads, head_dim)
    assert not q.is_contiguous() or num_tokens == 1
    cos, sin = _tables(64, head_dim, gen)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(DEVICE)
    v_before = v.clone()
    tlay.rotary_embedding(positions, q, k, cos, sin)
    layers.rotary_embedding_reference(positions, eq, ek, cos, sin)
    assert_matches(q, eq)
    assert_matches(k, ek)
    assert torch.equal(v, v_before), "v must not be touched"


def test_rotary_zero_tokens_is_a_no_op():
    """No token to rotate: the call returns without launching work that touches memory. The q and k
    views cover no row of a real projection buffer, and neither that buffer nor the tables change."""
    gen = torch.Generator().manual_seed(2)
    qkv = _qkv(4, 4, 2, 80, torch.bfloat16, gen)
    q, k, _ = _split(qkv, 4, 2, 80)
    cos, sin = _tables(8, 80, gen)
    before = (qkv.clone(), cos.clone(), sin.clone())
    tlay.rotary_embedding(torch.empty(0, dtype=torch.int64, device=DEVICE), q[:0], k[:0], cos, sin)
    assert torch.equal(qkv, before[0])
    assert torch.equal(cos, before[1])
    assert torch.equal(sin, before[2])


# --------------------------------------------------------------------------------------------- #
# SiLU-and-mul
# --------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", [80, 96, 2500])  # 2500: several column blocks per token
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_silu_and_mul_matches_reference(dtype, intermediate, num_tokens):
    gen = torch.Generator().manual_seed(intermediate + num_tokens)
    x = _randn(num_tokens, 2 * intermediate, dtype=dtype, gen=gen, scale=3.0)
    assert_matches(tlay.silu_and_mul(x), layers.silu_and_mul_reference(x))


def test_silu_and_mul_strided_rows_and_zero_tokens():
    gen = torch.Generator().manual_seed(3)
    x = _randn(7, 300, dtype=torch.float16, gen=gen)[:, :160]
    assert_matches(tlay.silu_and_mul(x), layers.silu_and_mul_reference(x))
    assert tlay.silu_and_mul(x[:0]).shape == (0, 80)


# --------------------------------------------------------------------------------------------- #
# Dispatch and the model
# --------------------------------------------------------------------------------------------- #


def _spy(monkeypatch: pytest.MonkeyPatch, module, name: str) -> list[str]:
    calls: list[str] = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows, width", [(1, 5000), (3, 129), (7, 70000), (64, 2049), (1, 1)])
def test_argmax_matches_torch(dtype, rows, width):
    """The chunked argmax equals torch's on fresh random rows of odd widths (chunks not dividing
    them), including ties: each row's maximum planted again in a later chunk, and once in an
    earlier column of the same chunk, where the first column must win."""
    gen = torch.Generator().manual_seed(rows * 100_000 + width)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    for r in range(rows):
        top = x[r].max()
        cols = torch.randint(0, width, (2,), generator=gen)
        x[r, cols] = top + 1  # two equal maxima: the first column wins
    x = x.to(DEVICE)
    assert torch.equal(tlay.argmax(x), x.argmax(dim=-1))


def test_argmax_dispatch(monkeypatch):
    """The kernel up to ARGMAX_TRITON_MAX_ROWS rows of ARGMAX_TRITON_MIN_WIDTH columns where Triton
    runs, torch's argmax otherwise."""
    x = torch.randn(layers.ARGMAX_TRITON_MAX_ROWS + 1, layers.ARGMAX_TRITON_MIN_WIDTH).to(DEVICE)
    calls = []
    monkeypatch.setattr(tlay, "argmax", lambda t: calls.append(t.shape[0]) or t.argmax(dim=-1))
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "triton")
    for rows in (1, layers.ARGMAX_TRITON_MAX_ROWS, layers.ARGMAX_TRITON_MAX_ROWS + 1):
        assert torch.equal(layers.argmax(x[:rows]), x[:rows].argmax(dim=-1))
    assert calls == [1, layers.ARGMAX_TRITON_MAX_ROWS]
    layers.argmax(x[:1, :-1])  # narrower rows
    assert calls == [1, layers.ARGMAX_TRITON_MAX_ROWS]
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "reference")
    layers.argmax(x[:1])
    assert calls == [1, layers.ARGMAX_TRITON_MAX_ROWS]


@pytest.mark.parametrize("choice", ["auto", "reference", "triton"])
def test_dispatch(monkeypatch: pytest.MonkeyPatch, choice: str) -> None:
    """CPU tensors take the reference unless forced; CUDA tensors take Triton unless forced."""
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", choice)
    calls = [
        *(
            _spy(monkeypatch, layers, f"{n}_reference")
            for n in ("rms_norm", "rotary_embedding", "silu_and_mul")
        ),
        *(_spy(monkeypatch, tlay, n) for n in ("rms_norm", "rotary_embedding", "silu_and_mul")),
    ]
    gen = torch.Generator().manual_seed(4)
    x = _randn(3, 64, dtype=torch.float32, gen=gen)
    q, k, _ = _split(_qkv(3, 2, 1, 16, torch.float32, gen), 2, 1, 16)
    cos, sin = _tables(8, 16, gen)
    layers.rms_norm(x, x[0], 1e-6, x)
    layers.rotary_embedding(torch.arange(3, device=DEVICE), q, k, cos, sin)
    layers.silu_and_mul(x)
    use_triton = choice == "triton" or (choice == "auto" and HAS_CUDA)
    assert [len(c) for c in calls] == ([0, 0, 0, 1, 1, 1] if use_triton else [1, 1, 1, 0, 0, 0])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # Odd sizes: hidden 80, head_dim 20, intermediate 144.
    spec = TinyModelSpec(hidden_size=80, intermediate_size=144, num_attention_heads=4, num_key_value_heads=2)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-layers"), spec)


def _forward(model_dir, dtype: torch.dtype) -> torch.Tensor:
    """Logits of the last token of three prompts (13, 1 and 6 tokens) in one step, from fresh caches;
    the one-token prompt is a decode to the attention kernels (a mixed batch)."""
    spec = load_model_spec(model_dir)
    model = CausalLM(spec, 64, torch.device(DEVICE), dtype)
    load_weights(model, spec, model_dir)
    block_size, lens = 16, [13, 1, 6]
    cache_shape = (4, block_size, spec.num_kv_heads, spec.head_dim)
    caches = [
        (
            torch.zeros(cache_shape, dtype=dtype, device=DEVICE),
            torch.zeros(cache_shape, dtype=dtype, device=DEVICE),
        )
        for _ in range(spec.num_layers)
    ]
    ids = torch.randint(3, spec.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(5))
    meta = AttentionMetadata(
        positions=torch.cat([torch.arange(n) for n in lens]).to(DEVICE),
        # One KV-cache group: [1, tokens] and [1, sequences, blocks].
        slot_mapping=torch.cat([torch.arange(n) + i * block_size for i, n in enumerate(lens)]).to(DEVICE)[
            None
        ],
        block_tables=torch.tensor([[[0], [1], [2]]], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=torch.tensor([0, 13, 14, 20], dtype=torch.int32, device=DEVICE),
    )
    return model(ids.to(DEVICE), meta, caches, torch.tensor([12, 13, 19], device=DEVICE))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)], ids=str)
def test_model_forward_triton_matches_reference(monkeypatch, tiny_dir, dtype, tol):
    """The whole forward pass with every Triton kernel (layers and attention) vs the references."""
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "reference")
    expected = _forward(tiny_dir, dtype)
    monkeypatch.setenv("PAGEDSERVE_ATTENTION", "triton")
    actual = _forward(tiny_dir, dtype)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------- #
# CUDA only
# --------------------------------------------------------------------------------------------- #


@needs_cuda
def test_cuda_offsets_beyond_2_pow_31_elements():
    """Rows past element 2^31 of x, the residual and the outputs are read and written correctly."""
    gen = torch.Generator().manual_seed(6)
    hidden = 4096
    num_tokens = 2**31 // hidden + 3
    x = torch.zeros((num_tokens, hidden), dtype=torch.bfloat16, device=DEVICE)
    residual = torch.zeros_like(x)
    x[-3:] = _randn(3, hidden, dtype=torch.bfloat16, gen=gen)
    residual[-3:] = _randn(3, hidden, dtype=torch.bfloat16, gen=gen)
    weight = _randn(hidden, dtype=torch.bfloat16, gen=gen)
    out, summed = tlay.rms_norm(x, weight, 1e-6, residual)
    assert_matches(summed[-3:], x[-3:] + residual[-3:])
    assert_matches(out[-3:], layers.rms_norm_reference(summed[-3:], weight, 1e-6))
    del out, summed, residual
    act = tlay.silu_and_mul(x)
    assert_matches(act[-3:], layers.silu_and_mul_reference(x[-3:]))
