"""The CUDA FP8-KV decode kernel (`kernels/fp8_decode.cu` through `kernels.cuda_decode`) against the
plain-torch reference, on fresh random inputs and odd shapes; and which launches it takes.

The kernel needs sm_89+, so the comparisons run on a GPU only; `applies` is checked on the CPU too.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cuda_decode, reference
from tests.test_fp8 import _batch, _fp8_attention_args
from tests.triton_marks import HAS_CUDA, needs_cuda

HEAD_DIM = 128


def _sm89() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


CASES = {
    # name: (q_lens, contexts, (q heads, kv heads), page size, q dtype)
    "decode": ([1, 1, 1], [40, 600, 70], (32, 8), 16, torch.bfloat16),
    "partial-pages": ([1] * 7, [1, 2, 15, 16, 17, 333, 1029], (32, 8), 16, torch.bfloat16),
    "mixed-batch": ([7, 1, 0, 19, 1, 1], [40, 300, 5, 19, 2, 70], (32, 8), 16, torch.bfloat16),
    "group-1": ([1, 1, 1], [40, 600, 70], (8, 8), 16, torch.bfloat16),
    "group-3": ([1, 1, 1], [40, 600, 70], (6, 2), 16, torch.bfloat16),
    "group-8": ([1, 1, 1], [40, 600, 70], (16, 2), 16, torch.bfloat16),
    "one-kv-head": ([1, 1, 1], [40, 600, 70], (8, 1), 16, torch.bfloat16),
    "six-kv-heads": ([1, 1, 1], [40, 600, 70], (12, 6), 16, torch.bfloat16),
    "pages-of-32": ([1, 1, 1, 1], [40, 600, 70, 33], (32, 8), 32, torch.bfloat16),
    "fp16": ([1, 1, 1], [40, 600, 70], (32, 8), 16, torch.float16),
    "long": ([1, 1], [5000, 9001], (32, 8), 16, torch.bfloat16),
}


def _fp8_args(case: str, seed: int):
    """`paged_attention`'s arguments over FP8 caches for one of CASES, and the k/v scales."""
    q_lens, contexts, heads, page, dtype = CASES[case]
    batch = _batch(q_lens, contexts, dtype, seed=seed, heads=heads, head_dim=HEAD_DIM, block_size=page)
    return _fp8_attention_args(batch)


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "config, num_splits",
    [(cuda_decode.default_config(), None), (cuda_decode.CudaDecodeConfig(4, 3), 1),
     (cuda_decode.CudaDecodeConfig(2, 4), 3), (cuda_decode.CudaDecodeConfig(8, 2), 5),
     (cuda_decode.CudaDecodeConfig(1, 2), 2)],
    ids=["default", "unsplit", "2-warps-3-splits", "8-warps-5-splits", "1-warp-2-splits"],
)  # fmt: skip
def test_cuda_fp8_decode_matches_reference(monkeypatch, case, config, num_splits):
    """Decodes of any length (partial last pages, splits past the context), query groups of 1-8,
    larger pages, fp16 queries and the decodes of a mixed batch (beside the varlen kernel)."""
    from pagedserve.kernels import triton_attention as ta

    if not _sm89():
        pytest.skip("FP8 conversions need sm_89+")
    monkeypatch.setattr(ta, "FP8_DECODE_CUDA", config)
    args, ks, vs = _fp8_args(case, seed=len(case))
    assert cuda_decode.applies(*args[:6], args[0])
    want = reference.paged_attention(*args, None, ks, vs).float()
    got = ta.paged_attention(*args, k_scale=ks, v_scale=vs, num_splits=num_splits).float()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_cuda_fp8_decode_under_a_cuda_graph():
    """The launch goes to the current stream, so a captured graph replays it with new inputs."""
    from pagedserve.kernels import triton_attention as ta

    if not _sm89():
        pytest.skip("FP8 conversions need sm_89+")
    args, ks, vs = _fp8_args("decode", seed=1)
    q = args[0].clone()
    out = torch.empty_like(q)
    ta.paged_attention(q, *args[1:], out=out, k_scale=ks, v_scale=vs)  # compile and size the scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.paged_attention(q, *args[1:], out=out, k_scale=ks, v_scale=vs)
    q.copy_(torch.randn_like(q))
    graph.replay()
    want = reference.paged_attention(q, *args[1:], None, ks, vs)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_applies_only_to_fp8_caches_of_the_shapes_it_was_written_for():
    """The Triton kernel keeps everything else: other head sizes, bigger groups, odd pages, bf16
    caches, int64 tables, CPU tensors."""
    args, _, _ = _fp8_args("decode", seed=0)
    q, k8, v8, tables, lens, cu = args[:6]
    assert cuda_decode.applies(q, k8, v8, tables, lens, cu, q) == (HAS_CUDA and _sm89())
    assert not cuda_decode.applies(q, k8.to(q.dtype), v8.to(q.dtype), tables, lens, cu, q)
    assert not cuda_decode.applies(q, k8, v8, tables.long(), lens, cu, q)
    cpu = [t.cpu() for t in (q, k8, v8, tables, lens, cu)]
    assert not cuda_decode.applies(*cpu, cpu[0])


def test_programs_hold_as_many_kv_heads_as_divide_the_models():
    """One warp per KV head: a program of 4 warps takes 4 of 8 heads, 2 of 6, 1 of 1, never a
    warp without a head."""
    config = cuda_decode.CudaDecodeConfig(warps=4, stages=3)
    assert [cuda_decode.fitted(config, n).warps for n in (8, 32, 6, 2, 1, 5)] == [4, 4, 2, 2, 1, 1]
    assert cuda_decode.fitted(config, 6).stages == 3


@pytest.mark.skipif(HAS_CUDA and not _sm89(), reason="FP8 conversions need sm_89+")
def test_a_kernel_that_does_not_compile_leaves_the_launch_to_triton(monkeypatch):
    """NVRTC or the driver refusing the kernel (injected) is logged once and the Triton decode
    kernel runs instead: on a GPU the result still matches the reference."""
    from pagedserve.kernels import triton_attention as ta

    def refuse(*args, **kwargs):
        raise RuntimeError("nvrtc: error: injected")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", refuse)
    config = cuda_decode.CudaDecodeConfig(warps=4, stages=5)  # a config no other test compiled
    args, ks, vs = _fp8_args("decode", seed=2)
    assert cuda_decode.compiled_kernel(args[0], args[1], config) is None
    if HAS_CUDA:
        monkeypatch.setattr(ta, "FP8_DECODE_CUDA", config)
        want = reference.paged_attention(*args, None, ks, vs).float()
        got = ta.paged_attention(*args, k_scale=ks, v_scale=vs).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
