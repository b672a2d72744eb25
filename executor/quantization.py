"""FP8 on Hopper: `--quantization fp8` (e4m3 weights, per-token activations) and
`--kv-cache-dtype fp8` (an e4m3 KV pool with per-layer scales).

Weights. `Fp8Linear` holds an e4m3 [N, K] weight and one float32 scale per output row. A bf16/fp16
checkpoint is quantized at load, tensor by tensor on the device (`load_weight_slice`), so the full
precision model never exists there; a checkpoint that already carries FP8 weights (the
compressed-tensors / vLLM "fp8" layout: `weight` in float8_e4m3fn plus `weight_scale`, per tensor
or per channel) is copied as is. Its activations arrive quantized per token by the kernel that
made them (`kernels.fp8.rms_norm_quant`, `silu_and_mul_quant`) or are quantized in one pass
(`quantize_per_token`, the attention output before o_proj). Embeddings, norms and the LM head stay
in the model dtype.

Small M. A step of at most `weight_only_max_m()` tokens (decode at small batches) is bound by
reading the weights; there the norms and SiLU-and-mul before an Fp8Linear hand over activations in
the model dtype (`rms_norm_for_fp8`, `silu_and_mul_for_fp8`) and the projection runs the weight-only
kernel (`kernels.fp8.weight_only_linear`: the same e4m3 weights and scales, widened in registers),
saving the activation quantization and `_scaled_mm`'s large-M tiles. The choice depends on the
step's token count only, a shape, so each CUDA graph (one per padded batch size) captures one path.
The same GEMV kernel takes the 16-bit projections and the LM head of one-token steps
(`dense_matmul`, `BF16_GEMV_MAX_M`), where it beats cuBLAS. At one token it also applies the
RMSNorm before qkv, gate_up and the LM head itself (`normed_gemv`), in either weight format.

KV cache. The pool stores e4m3; each layer's `Attention` owns k_scale / v_scale (float32 [1] on the
device, read by the kernels through a pointer so CUDA graphs captured before calibration see the
final values). They come from the checkpoint (`...self_attn.k_scale` / `v_scale`, or
compressed-tensors' `k_proj.output_scale` / `v_proj.output_scale`) or, failing that, from the first
real step (`kv_scale_from_amax`, as vLLM's calculate_kv_scales): the runner runs that step eagerly
with calibration on.

Hardware. Both need FP8 support: `_scaled_mm` with row-wise scales needs sm90 (Hopper) for the
weights; the e4m3 casts of the KV kernels need sm89+. Elsewhere the flags fail at start
(`check_fp8_support`). Tests run the plain-torch references on the CPU by setting
PAGEDSERVE_FP8_REFERENCE=1 (slow, float32 math: a correctness path, not a serving one).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.spec import UnsupportedModelError
from pagedserve.kernels import _use_triton, fp8, layers

QUANTIZATIONS = (None, "fp8")
# kernels.triton_fp8_gemv.GEMV_MAX_M, without importing Triton here (CPU installs may lack it)
_GEMV_MAX_M = 4
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_KV_DTYPE = torch.float8_e4m3fn
REFERENCE_ENV = "PAGEDSERVE_FP8_REFERENCE"
# Calibrated KV scales leave this factor of headroom over the first step's largest |k| and |v|: later
# tokens may be larger than the first prompt's (vLLM divides by 200 for K and 100 for V instead of
# 448, i.e. 2.2x and 4.5x headroom). e4m3 keeps its 3-bit mantissa over ~17 binades, so headroom
# costs precision only for the tiniest values.
KV_SCALE_HEADROOM = 2.0
# ...and never a scale below this (a first step of near-zero keys must not make every later key
# saturate): |values| up to 1 are always representable.
MIN_KV_SCALE = 1.0 / fp8.FP8_MAX


# Steps of at most this many tokens run FP8 projections weight-only (bf16 activations against the
# widened e4m3 weights), larger ones quantize the activations per token for `_scaled_mm`.
# Measured with benchmarks/small_m.py on the H200 (benchmarks/results/2026-12-03-h200): on the
# llama-8b shapes at M = 1, 2 and 4 the weight-only kernel took ~100 us per layer against ~122
# for `_scaled_mm` (and for bf16), winning on o, gate_up, down and the LM head (qkv within 1 us);
# from M = 8 `_scaled_mm`'s small-M tiles catch up (a tie per layer, the LM head ~20% faster).
WEIGHT_ONLY_MAX_M = 4
# Overrides WEIGHT_ONLY_MAX_M for the process (read once, at import): benchmarks sweep it, and
# 0 turns the weight-only path off.
WEIGHT_ONLY_MAX_M_ENV = "PAGEDSERVE_FP8_WEIGHT_ONLY_MAX_M"


# Steps of at most this many tokens run their 16-bit (bf16/fp16) projections and LM head on the
# GEMV kernel (`kernels.triton_fp8_gemv.linear_16bit`, at most its GEMV_MAX_M rows) instead of
# cuBLAS (0: never). One row, measured on the H200 (benchmarks/results/2026-12-04-h200): the GEMV
# beats cuBLAS on every llama-8b shape at M = 1 and takes one request's per-token latency from
# 4.86 to 4.53 ms; at 2 rows it lost on gate_up in one of two runs of `benchmarks.small_m`.
BF16_GEMV_MAX_M = 1
BF16_GEMV_MAX_M_ENV = "PAGEDSERVE_BF16_GEMV_MAX_M"
# PAGEDSERVE_NORM_IN_GEMV=0 keeps every RMSNorm a launch of its own (`gemv_norm_applies`; for
# comparisons, read once at import).
NORM_IN_GEMV_ENV = "PAGEDSERVE_NORM_IN_GEMV"
_norm_in_gemv = os.environ.get(NORM_IN_GEMV_ENV, "1") != "0"


def _read_max_m(env: str, default: int) -> int:
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{env} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{env} must be >= 0, got {value}")
    return value


def _read_weight_only_max_m() -> int:
    return _read_max_m(WEIGHT_ONLY_MAX_M_ENV, WEIGHT_ONLY_MAX_M)


def _read_bf16_gemv_max_m() -> int:
    return _read_max_m(BF16_GEMV_MAX_M_ENV, BF16_GEMV_MAX_M)


_weight_only_max_m = _read_weight_only_max_m()
_bf16_gemv_max_m = _read_bf16_gemv_max_m()


def weight_only_max_m() -> int:
    """The largest step (tokens) whose FP8 projections run weight-only (0: never)."""
    return _weight_only_max_m


def set_weight_only_max_m(value: int) -> None:
    """Sets the threshold for this process (tests, in-process benchmarks); before any CUDA graph is
    captured, since a captured graph keeps the path it was captured with."""
    global _weight_only_max_m
    if value < 0:
        raise ValueError(f"weight-only max M must be >= 0, got {value}")
    _weight_only_max_m = value


def uses_weight_only(num_tokens: int) -> bool:
    """Whether a step of `num_tokens` rows runs its FP8 projections weight-only."""
    return num_tokens <= _weight_only_max_m


def bf16_gemv_max_m() -> int:
    """The largest step (tokens) whose 16-bit projections run on the GEMV kernel (0: never)."""
    return _bf16_gemv_max_m


def set_bf16_gemv_max_m(value: int) -> None:
    """As `set_weight_only_max_m`, for the 16-bit GEMV threshold."""
    global _bf16_gemv_max_m
    if value < 0:
        raise ValueError(f"bf16 GEMV max M must be >= 0, got {value}")
    _bf16_gemv_max_m = value


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` of a model-dtype projection (and the LM head): on the GEMV
    kernel for steps of at most `bf16_gemv_max_m()` tokens (capped at the kernel's GEMV_MAX_M)
    with 16-bit weights and activations of one dtype on CUDA (or forced, as `kernels.layers`),
    cuBLAS otherwise. By the token count only, so a captured graph keeps one path."""
    if _on_16bit_gemv(x, weight):
        from pagedserve.kernels import triton_fp8_gemv

        return triton_fp8_gemv.linear_16bit(x, weight, bias)
    return F.linear(x, weight, bias)


def _on_16bit_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`dense_matmul`'s choice of the GEMV kernel."""
    m = x.shape[0] if x.dim() == 2 else -1
    return (
        0 < m <= min(_bf16_gemv_max_m, _GEMV_MAX_M)
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and _use_triton(x)
    )


def gemv_silu_and_mul_applies(x: torch.Tensor | fp8.QuantizedActivation, weight: torch.Tensor) -> bool:
    """Whether SwiGLU's gate | up projection `weight` of a step of x's rows runs as one GEMV launch
    that applies SiLU-and-mul in its epilogue (`gemv_silu_and_mul`): where the projection alone
    would run on the GEMV kernel (`dense_matmul`'s and `fp8_matmul`'s choice by the token count, so
    a captured graph keeps one path) and the kernel takes the shape without a K split. Saves the
    activation's launch and its round trip through memory in a small-batch decode step."""
    if not _on_gemv(x, weight):
        return False
    from pagedserve.kernels import triton_fp8_gemv

    return triton_fp8_gemv.fuses_silu_and_mul(x.shape[0], *weight.shape, weight.dtype, x.device)


def _on_gemv(x: torch.Tensor | fp8.QuantizedActivation, weight: torch.Tensor) -> bool:
    """Whether the projection `weight` of a step of x's rows runs on the GEMV kernel:
    `dense_matmul`'s and `fp8_matmul`'s choice, by the token count."""
    if isinstance(x, fp8.QuantizedActivation):
        return False
    if weight.dtype != fp8.FP8_DTYPE:
        return _on_16bit_gemv(x, weight)
    from pagedserve.kernels import triton_fp8_gemv

    m = x.shape[0] if x.dim() == 2 else -1
    return 0 < m <= triton_fp8_gemv.FP8_GEMV_MAX_M and uses_weight_only(m) and _use_triton(x)


def gemv_norm_applies(x: torch.Tensor, weight: torch.Tensor, silu_and_mul: bool = False) -> bool:
    """Whether the RMSNorm before the projection `weight` (and SiLU-and-mul after it) of a step of
    x's rows runs inside that projection's GEMV (`normed_gemv`): a one-token step, where the
    projection runs on the GEMV kernel without a K split. Saves the norm's launch, twice a layer,
    at one request (`kernels.triton_fp8_gemv.GemvNorm`). By shapes only: a graph keeps one path."""
    if not _norm_in_gemv or not _on_gemv(x, weight):
        return False
    from pagedserve.kernels import triton_fp8_gemv

    m, (n, k) = x.shape[0], weight.shape
    fuses = triton_fp8_gemv.fuses_norm(m, n, k, weight.dtype, x.device)
    return fuses and (not silu_and_mul or triton_fp8_gemv.fuses_silu_and_mul(m, n, k, weight.dtype, x.device))


def normed_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers.rms_norm(x, norm_weight, eps, residual)`, then the projection (e4m3 `weight` with
    its scales, or 16-bit with None), then SiLU-and-mul if asked, in one GEMV launch; only where
    `gemv_norm_applies`. Returns (the output, the residual stream: x + residual, or x)."""
    from pagedserve.kernels import triton_fp8_gemv

    residual_out = None if residual is None else torch.empty_like(x)
    norm = triton_fp8_gemv.GemvNorm(norm_weight, eps, residual, residual_out)
    y = triton_fp8_gemv.gemv(x, weight, weight_scale, bias, x.dtype, silu_and_mul=silu_and_mul, norm=norm)
    return y, (x if residual_out is None else residual_out)


def gemv_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None
) -> torch.Tensor:
    """`layers.silu_and_mul(x @ W^T)` of a gate | up weight (e4m3 with its scales, or 16-bit with
    None) in one GEMV launch; only where `gemv_silu_and_mul_applies`."""
    from pagedserve.kernels import triton_fp8_gemv

    return triton_fp8_gemv.gemv(x, weight, weight_scale, None, x.dtype, silu_and_mul=True)


def rms_norm_for_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> fp8.QuantizedActivation | torch.Tensor | tuple:
    """The norm before an Fp8Linear: model-dtype output for the weight-only path, else per-token
    FP8 activations from the same kernel (`kernels.fp8.rms_norm_quant`)."""
    norm: Callable = layers.rms_norm if uses_weight_only(x.shape[0]) else fp8.rms_norm_quant
    return norm(x, weight, eps, residual)


def silu_and_mul_for_fp8(x: torch.Tensor) -> fp8.QuantizedActivation | torch.Tensor:
    """SiLU-and-mul before an FP8 down_proj: as `rms_norm_for_fp8`, by the step's token count."""
    if uses_weight_only(x.shape[0]):
        return layers.silu_and_mul(x)
    return fp8.silu_and_mul_quant(x)


def fp8_matmul(
    x: torch.Tensor | fp8.QuantizedActivation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """An Fp8Linear's product: `_scaled_mm` for quantized activations; for model-dtype ones the
    weight-only kernel at small M, else quantized per token first."""
    if isinstance(x, fp8.QuantizedActivation):
        return fp8.fp8_linear(x, weight, weight_scale, bias, out_dtype)
    if uses_weight_only(x.shape[0]):
        return fp8.weight_only_linear(x, weight, weight_scale, bias, out_dtype)
    return fp8.fp8_linear(fp8.quantize_per_token(x), weight, weight_scale, bias, out_dtype)


class Fp8UnsupportedError(UnsupportedModelError):
    """An FP8 flag on hardware without FP8 support."""


def check_fp8_support(quantization: str | None, kv_cache_dtype: str, device: torch.device) -> None:
    """Fails with a message naming the flag and the device when FP8 cannot run there.

    PAGEDSERVE_FP8_REFERENCE=1 lets the CPU run the plain-torch references (tests).
    """
    wanted = []
    if quantization == "fp8":
        wanted.append(("--quantization fp8", (9, 0), "row-wise scaled FP8 matmuls (torch._scaled_mm)"))
    if kv_cache_dtype == "fp8":
        wanted.append(("--kv-cache-dtype fp8", (8, 9), "e4m3 conversions in the attention kernels"))
    if not wanted:
        return
    if device.type != "cuda":
        if os.environ.get(REFERENCE_ENV) == "1":
            return
        flags = " and ".join(flag for flag, _, _ in wanted)
        raise Fp8UnsupportedError(
            f"{flags} needs an NVIDIA GPU with FP8 support (Hopper, compute capability 9.0, for "
            f"--quantization; 8.9+ for the KV cache), but the executor runs on the {device.type}; "
            "drop the flag (or, for tests only, set PAGEDSERVE_FP8_REFERENCE=1 to run the slow "
            "plain-torch reference)"
        )
    capability = torch.cuda.get_device_capability(device)
    for flag, needed, why in wanted:
        if capability < needed:
            raise Fp8UnsupportedError(
                f"{flag} needs compute capability {needed[0]}.{needed[1]}+ ({why}); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
            )


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return FP8_KV_DTYPE if kv_cache_dtype == "fp8" else model_dtype


def kv_scale_from_amax(x: torch.Tensor) -> torch.Tensor:
    """float32 [1]: max(|x|) * headroom / 448, at least MIN_KV_SCALE; stays on x's device."""
    amax = x.detach().abs().amax().float().view(1)
    return (amax * (KV_SCALE_HEADROOM / fp8.FP8_MAX)).clamp(min=MIN_KV_SCALE)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 and per-output-channel scales; x quantized per token, or, at
    small M, kept in the model dtype for the weight-only kernel (`fp8_matmul`).

    Parameters: `weight` [rows, cols] float8_e4m3fn, `weight_scale` [rows] float32, optional `bias`
    [rows] in the model dtype; uninitialised until the loader fills them (see
    `load_weight_slice`).
    """

    def __init__(self, rows: int, cols: int, bias: bool, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_dtype = dtype
        self.weight = nn.Parameter(
            torch.empty(rows, cols, device=device, dtype=fp8.FP8_DTYPE), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(rows, device=device, dtype=torch.float32), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(rows, device=device, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor | fp8.QuantizedActivation) -> torch.Tensor:
        return fp8_matmul(x, self.weight, self.weight_scale, self.bias, self.out_dtype)


def is_fp8_weight(param: torch.Tensor) -> bool:
    return param.dtype == fp8.FP8_DTYPE


def load_weight_slice(
    weight: torch.Tensor, weight_scale: torch.Tensor, offset: int, rows: int, tensor: torch.Tensor
) -> None:
    """Fills rows [offset, offset + rows) of an Fp8Linear from a checkpoint tensor.

    A float8 tensor is copied as is (its scale arrives separately, see `load_scale_slice`); any
    other dtype is quantized per output row on the weight's device.
    """
    view = weight if rows == -1 else weight.narrow(0, offset, rows)
    scale_view = weight_scale if rows == -1 else weight_scale.narrow(0, offset, rows)
    if view.shape != tensor.shape:
        raise UnsupportedModelError(f"checkpoint shape {tuple(tensor.shape)} != expected {tuple(view.shape)}")
    if tensor.dtype == fp8.FP8_DTYPE:
        view.view(torch.uint8).copy_(tensor.view(torch.uint8))
        return
    q, scale = fp8.quantize_weight(tensor.to(view.device))
    view.view(torch.uint8).copy_(q.view(torch.uint8))
    scale_view.copy_(scale)


def load_scale_slice(weight_scale: torch.Tensor, offset: int, rows: int, tensor: torch.Tensor) -> None:
    """Fills the scales of rows [offset, offset + rows) from a checkpoint `weight_scale`: one value
    (per tensor) or one per row ([rows] or [rows, 1])."""
    view = weight_scale if rows == -1 else weight_scale.narrow(0, offset, rows)
    flat = tensor.reshape(-1).float()
    if flat.numel() == 1:
        view.fill_(flat.item())
    elif flat.numel() == view.numel():
        view.copy_(flat)
    else:
        raise UnsupportedModelError(
            f"weight_scale of {tuple(tensor.shape)} fits neither per-tensor nor per-channel "
            f"scaling of {view.numel()} rows (block-wise FP8 checkpoints are not supported)"
        )
