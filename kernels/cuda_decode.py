"""The CUDA decode kernel for FP8 KV caches (`fp8_decode.cu`): compiled at first use by NVRTC,
launched by `triton_attention` in place of the Triton decode kernel where it applies.

Why a CUDA kernel: every Triton decode loop tried over an e4m3 cache moved its bytes at 0.47-0.74x
of the bf16 kernel's rate (README, FP8). The CUDA kernel gives each warp a private cp.async
pipeline of `stages` units of 16 keys, so that loads stay in flight while the warp computes, and
widens the bytes straight into mma.sync operands (the .cu file explains the operand maps). Each
warp takes one KV head of one split alone, with no merge between warps.

It covers the common shapes (head_dim 128, up to 8 query heads per KV head, pages of a multiple of
16 keys, bf16 or fp16 queries, int32 index tensors, sm_89+); `applies` says when, and the Triton
kernel takes everything else. Splits use `attention_jit.merge_kernel`, so the partial layout is the
Triton kernel's.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import structlog
import torch

__all__ = ["CudaDecodeConfig", "applies", "compiled_kernel", "default_config", "fitted", "launch"]

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).with_name("fp8_decode.cu")
_UNIT = 16  # keys per warp step
_HEAD_DIM = 128
_MAX_GROUP = 8


@dataclass(frozen=True)
class CudaDecodeConfig:
    """Warps per program, one KV head each, and pipeline depth (units of 16 keys of K and V, 4 KB,
    per warp)."""

    warps: int
    stages: int

    @property
    def shared_bytes(self) -> int:
        return self.warps * self.stages * 2 * _UNIT * _HEAD_DIM


def default_config() -> CudaDecodeConfig:
    """4 warps, 3 stages (48 KB; 116-124 registers by ptxas for sm_90, so 4 programs per SM).

    On the H200 (`benchmarks/results/2026-12-02-h200-s3/call1-warp-per-head.json`) 8 x 3, 2 x 4, 4 x 4 and
    4 x 5 came within 1-2% of it at the large K1 shapes, 4 x 2 within 2% (ahead at (256, 1024) and
    (512, 1024), behind elsewhere); none was ahead everywhere.
    """
    return CudaDecodeConfig(warps=4, stages=3)


@functools.lru_cache(maxsize=64)
def fitted(config: CudaDecodeConfig, num_kv_heads: int) -> CudaDecodeConfig:
    """`config` with as many warps as divide `num_kv_heads` (2 for a model with 2 or 6 KV heads),
    so that no warp of a program is left without a head while holding its shared memory."""
    return replace(config, warps=math.gcd(config.warps, num_kv_heads))


@functools.lru_cache(maxsize=8)
def _device_supports(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def applies(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, out: torch.Tensor,
) -> bool:  # fmt: skip
    """Whether the CUDA kernel takes this decode launch (shapes, dtypes, layouts and the device:
    sm_89+, and the current one, whose context the kernel is launched in)."""
    if not (q.is_cuda and k_cache.dtype == torch.float8_e4m3fn):
        return False
    if q.device.index != torch.cuda.current_device() or not _device_supports(q.device.index):
        return False
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    return (
        head_dim == _HEAD_DIM
        and num_q_heads // num_kv_heads <= _MAX_GROUP
        and k_cache.shape[1] % _UNIT == 0
        and q.dtype in (torch.bfloat16, torch.float16)
        and out.dtype == q.dtype
        and all(t.dtype == torch.int32 for t in (block_tables, seq_lens, cu_seqlens_q))
        and q.stride(2) == 1 and out.stride(2) == 1
        and q.data_ptr() % 16 == 0 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0
        and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
        and all(s % 16 == 0 for s in (*k_cache.stride()[:3], *v_cache.stride()[:3]))
        and all(t.data_ptr() % 16 == 0 for t in (k_cache, v_cache))
    )  # fmt: skip


def compiled_kernel(
    q: torch.Tensor, k_cache: torch.Tensor, config: CudaDecodeConfig, fit_splits: bool = True
) -> int | None:
    """The kernel for these shapes (NVRTC at first use, then cached), or None where it does not
    compile here: the failure is logged once and the launch is left to the Triton kernel.
    fit_splits: each token spreads its own context over the splits (`triton_attention.FIT_SPLITS`)."""
    group = q.shape[1] // k_cache.shape[2]
    return _kernel(group, k_cache.shape[1], q.dtype == torch.bfloat16, config, q.device.index, fit_splits)


@functools.lru_cache(maxsize=32)
def _kernel(
    group: int, page_size: int, q_bf16: bool, config: CudaDecodeConfig, device_index: int, fit_splits: bool
) -> int | None:
    """The compiled kernel's CUfunction handle (loaded into the device's primary context), or None
    where NVRTC or the driver refuses it."""
    defines = dict(
        HEAD_DIM=_HEAD_DIM, GROUP=group, PAGE_SIZE=page_size, STAGES=config.stages, WARPS=config.warps,
        Q_BF16=int(q_bf16), FIT_SPLITS=int(fit_splits),
    )  # fmt: skip
    source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + _SOURCE.read_text()
    try:
        with torch.cuda.device(device_index):
            kernel = torch.cuda._compile_kernel(source, "fp8_paged_decode")
            kernel.set_shared_memory_config(config.shared_bytes)
    except Exception as exc:  # any failure: the Triton kernel runs instead
        log.warning("fp8_decode_cuda_unavailable", error=str(exc)[:500], fallback="triton", **defines)
        return None
    return kernel.func.value


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    return lib


# The kernel's parameters packed as the C ABI lays them out (`struct` native alignment): ten
# pointers, the softmax scale (double), eighteen ints. Passed as one buffer
# (CU_LAUNCH_PARAM_BUFFER_POINTER), which costs a few microseconds per launch where a ctypes
# array of per-argument pointers costs tens.
_PARAMS = struct.Struct("@10Pd18i")
_BUFFER_POINTER, _BUFFER_SIZE, _END = 1, 2, 0


def launch(
    kernel: int,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    part: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    qk_scale: float,
    grid: tuple[int, int, int],
    num_splits: int,
    tokens_per_split: int,
    part_rows: int,
    by_seq: bool,
    config: CudaDecodeConfig,
) -> None:
    """One launch of `kernel` (from `compiled_kernel`) on the current stream, so CUDA graphs capture
    it; qk_scale includes log2(e), as the Triton kernel's."""
    params = ctypes.create_string_buffer(
        _PARAMS.pack(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), part.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), cu_seqlens_q.data_ptr(), k_scale.data_ptr(),
            v_scale.data_ptr(), qk_scale, seq_lens.shape[0], num_splits, tokens_per_split, part_rows,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            out.stride(0), out.stride(1), block_tables.stride(0), block_tables.shape[1], int(by_seq),
            k_cache.shape[2],
        ),
        _PARAMS.size,
    )  # fmt: skip
    size = ctypes.c_size_t(_PARAMS.size)
    extra = (ctypes.c_void_p * 5)(
        _BUFFER_POINTER, ctypes.addressof(params), _BUFFER_SIZE, ctypes.addressof(size), _END
    )
    stream = torch.cuda.current_stream(q.device).cuda_stream
    result = _libcuda().cuLaunchKernel(
        kernel, *grid, 32 * config.warps, 1, 1, config.shared_bytes, stream, None, extra
    )
    if result != 0:
        raise RuntimeError(f"fp8_paged_decode launch failed: CUresult {result}")
