"""Our decoder forward pass, shared by every family, over a flattened, unpadded batch of tokens.

A family (`executor.models`) is a `ModelSpec`: the norm kind, the MLP kind (SwiGLU, GeGLU or
routed experts, `executor.moe`), per-layer attention windows and rotary embeddings, soft-caps, q/k
norms, an embedding scale. The layers below read those traits once, at construction, so the forward
itself has no per-family code and no data-dependent control flow (it stays capturable in a CUDA graph).

Every sequence of a step contributes its new tokens to one [num_tokens, hidden] matrix, so prefill
chunks and decode tokens share the same matmuls. Attention writes the new K/V into the paged pool
(`kernels.write_kv`) and attends over it (`kernels.paged_attention`, with the layer's sliding window
and soft-cap); where each token goes and what it sees travels in an explicit `AttentionMetadata`,
never in module globals. The elementwise work of a layer (RMSNorm with the residual add fused in,
rotary, SiLU-and-mul) runs as one kernel each (`kernels.layers`).

With `quantization="fp8"` the four projections of each layer (and the experts) are FP8
(`executor.quantization.Fp8Linear`) and the Llama-order norms and SiLU-and-mul before them hand over
per-token FP8 activations (`kernels.fp8`), or at small M model-dtype ones for the weight-only
kernel (`executor.quantization.weight_only_max_m`); Gemma's norms and GeGLU hand over full precision, which
Fp8Linear quantizes itself. With an FP8 KV pool each layer's k_scale / v_scale buffers travel with
its caches to `write_kv` and the attention kernels.

Tensor parallelism (`executor.parallel`): built from a rank's local spec (its heads, MLP rows and
expert rows) and given the group's `all_reduce`, the model makes o_proj, down_proj and the experts'
combine row-parallel (partial sums all-reduced, the bias added after); without it (one rank) the
layers are the plain ones, so one rank runs exactly the single-device code. Ranks other than 0 skip
the LM head (`computes_logits`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.executor.kv_groups import KVCacheGroups
from pagedserve.executor.moe import SparseMoE
from pagedserve.executor.quantization import (
    QUANTIZATIONS,
    Fp8Linear,
    dense_matmul,
    fp8_matmul,
    gemv_norm_applies,
    gemv_silu_and_mul,
    gemv_silu_and_mul_applies,
    kv_scale_from_amax,
    normed_gemv,
    rms_norm_for_fp8,
    silu_and_mul_for_fp8,
)
from pagedserve.executor.rotary import RotaryEmbedding, rope_inv_freq
from pagedserve.executor.spec import ModelSpec, RopeConfig
from pagedserve.kernels import fp8, layers

__all__ = ["AttentionMetadata", "CausalLM", "RotaryEmbedding", "rope_inv_freq"]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens sit; all tensors on the model's device.

    Attributes:
        positions: [num_tokens] int64, position of each token in its sequence.
        slot_mapping: [num_groups, num_tokens] int64, per KV-cache group (executor.kv_groups),
            block_id * block_size + offset where the token's K/V is written.
        block_tables: [num_groups, num_seqs, max_blocks] int32, each sequence's physical blocks per
            group (zero padded; a sliding-window group's entries before its window are stale).
        seq_lens: [num_seqs] int32, context length of each sequence including its new tokens.
        cu_seqlens_q: [num_seqs + 1] int32, row ranges of each sequence's tokens.
        decode_only: every sequence has exactly one new token (known on the host: a decode graph,
            an eager step checked); lets the decode kernel rotate and write the new keys itself
            (`kernels.rotary_paged_attention`).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    decode_only: bool = False


def _param(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: the loader overwrites every parameter, and random init of an 8B
    # model would cost seconds for nothing.
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the reduction in float32 as in the reference implementations.

    Given the residual stream too, it first adds x into it (one fused kernel) and returns
    (normed, new residual): see `kernels.layers.rms_norm`. `kind` "gemma" multiplies by
    (1 + weight) in float32 instead (`kernels.layers.gemma_rms_norm`); `quantize` (a Llama-order
    norm before an Fp8Linear) outputs per-token FP8 activations.
    """

    def __init__(
        self,
        size: int,
        eps: float,
        device: torch.device,
        dtype: torch.dtype,
        quantize: bool = False,
        kind: str = "rms",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size, device=device, dtype=dtype)
        self.kind = kind
        if kind == "gemma":
            self._norm = layers.gemma_rms_norm  # an Fp8Linear after it quantizes its input itself
        else:
            self._norm = rms_norm_for_fp8 if quantize else layers.rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self._norm(x, self.weight, self.eps, residual)

    def then_project(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        proj: Linear | Fp8Linear,
        silu_and_mul: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(proj(norm(x + residual)), the residual stream x + residual) where residual None means
        none, with SiLU-and-mul after the projection if asked: one GEMV launch at one token
        (`normed_gemv`), else the norm's launch, then the projection's (`silu_and_mul` only where
        the GEMV takes it, `gemv_silu_and_mul_applies`)."""
        weight = proj.weight
        if self.kind == "rms" and gemv_norm_applies(x, weight, silu_and_mul):
            return normed_gemv(
                x, residual, self.weight, self.eps, weight, proj.weight_scale, proj.bias, silu_and_mul
            )
        x, residual = (self(x), x) if residual is None else self(x, residual)
        if silu_and_mul:
            return gemv_silu_and_mul(x, weight, proj.weight_scale), residual
        return proj(x), residual


class Linear(nn.Module):
    """y = x W^T (+ b) with uninitialised parameters (nn.Linear would initialise them randomly)."""

    weight_scale = None  # as Fp8Linear's: 16-bit weights have none

    def __init__(self, rows: int, cols: int, bias: bool, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(rows, cols, device=device, dtype=dtype)
        self.bias = _param(rows, device=device, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_matmul(x, self.weight, self.bias)


AllReduce = Callable[[torch.Tensor], object]  # sums a tensor over the tensor-parallel group, in place


class RowParallelLinear(Linear):
    """A rank's columns of a row-parallel projection: partial x W^T, summed over the ranks, + b.

    The bias is added once, after the all-reduce (each rank holds it whole). `all_reduce` is set by
    `_linear`."""

    all_reduce: AllReduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dense_matmul(x, self.weight)
        self.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)


class Fp8RowParallelLinear(Fp8Linear):
    """`RowParallelLinear` with FP8 weights: the per-output-row scales apply to the partial sums."""

    all_reduce: AllReduce

    def forward(self, x: torch.Tensor | fp8.QuantizedActivation) -> torch.Tensor:
        y = fp8_matmul(x, self.weight, self.weight_scale, None, self.out_dtype)
        self.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)


def _linear(
    rows: int,
    cols: int,
    bias: bool,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    all_reduce: AllReduce | None = None,
) -> Linear | Fp8Linear:
    """A projection; row-parallel (its output all-reduced) when given the group's `all_reduce`."""
    if all_reduce is not None:
        cls = Fp8RowParallelLinear if quantization == "fp8" else RowParallelLinear
        layer = cls(rows, cols, bias, device, dtype)
        layer.all_reduce = all_reduce
        return layer
    if quantization == "fp8":
        return Fp8Linear(rows, cols, bias, device, dtype)
    return Linear(rows, cols, bias, device, dtype)


class Embedding(nn.Module):
    """Token embedding table (its weight doubles as the LM head when embeddings are tied), times
    `scale` when given (Gemma), the scale rounded to the model dtype first as transformers does."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.weight = _param(vocab_size, hidden_size, device=device, dtype=dtype)
        scale_tensor = None if scale is None else torch.tensor(scale).to(device=device, dtype=dtype)
        self.register_buffer("scale", scale_tensor, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.weight)
        return x if self.scale is None else x * self.scale


class Attention(nn.Module):
    """GQA/MHA self-attention with fused q/k/v projection over the paged KV pool.

    Per family and layer (from the spec): q/k RMSNorms over each head before the rotary embedding,
    the layer's rotary embedding and sliding window, the softmax scale and score soft-cap.
    """

    def __init__(
        self,
        spec: ModelSpec,
        window: int | None,
        rotary: RotaryEmbedding,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str | None = None,
        all_reduce: AllReduce | None = None,
        kv_group: int = 0,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.scale = spec.head_dim**-0.5 if spec.attn_scale is None else spec.attn_scale
        self.kv_group = kv_group  # whose block tables and slot mapping the layer uses
        self.sliding_window = window
        self.soft_cap = spec.attn_soft_cap
        self.rotary = rotary
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = _linear(qkv_rows, spec.hidden_size, spec.qkv_bias, device, dtype, quantization)
        self.o_proj = _linear(
            spec.hidden_size, self.q_size, spec.o_bias, device, dtype, quantization, all_reduce
        )
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, device, dtype, kind=spec.norm)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, device, dtype, kind=spec.norm)
        else:
            self.q_norm = self.k_norm = None
        # Scales of an FP8 KV pool (ignored by the kernels for other pools); 1.0 until the loader
        # or the first step's calibration sets them.
        self.register_buffer("k_scale", torch.ones(1, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, device=device), persistent=False)
        self.calibrate_kv_scales = False  # set for one eager step by the runner (executor.quantization)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), meta, k_cache, v_cache)

    def attend(
        self, qkv: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """`forward` after the q | k | v projection (which the decoder layer may run in one launch
        with the norm before it)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # over each head: rows of head_dim (new, contiguous tensors)
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        group = self.kv_group
        slots = meta.slot_mapping[group]
        context = (meta.block_tables[group], meta.seq_lens, meta.cu_seqlens_q, self.scale)
        options = dict(
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
        )
        if self.calibrate_kv_scales or self.rotary.partial:
            self.rotary(meta.positions, q, k)  # in place (views of the qkv output, or the normed copies)
            if self.calibrate_kv_scales:
                self.k_scale.copy_(kv_scale_from_amax(k))
                self.v_scale.copy_(kv_scale_from_amax(v))
            kernels.write_kv(k, v, k_cache, v_cache, slots, self.k_scale, self.v_scale)
            out = kernels.paged_attention(q, k_cache, v_cache, *context, **options)
        else:  # the same in fewer launches
            cos, sin = self.rotary.cos, self.rotary.sin
            out = kernels.rotary_paged_attention(
                meta.positions, q, k, v, cos, sin, k_cache, v_cache, slots, *context,
                decode_only=meta.decode_only, **options,
            )  # fmt: skip
        return self.o_proj(out.reshape(-1, self.q_size))


_ACTIVATIONS = {  # mlp_act -> (plain, FP8-quantizing) activation of the fused gate_up output
    "silu": (layers.silu_and_mul, silu_and_mul_for_fp8),
    "gelu_tanh": (layers.gelu_tanh_and_mul, layers.gelu_tanh_and_mul),  # down_proj quantizes itself
}


class MLP(nn.Module):
    """SwiGLU (or Gemma's GeGLU) with gate and up fused into one matmul."""

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str | None = None,
        all_reduce: AllReduce | None = None,
    ) -> None:
        super().__init__()
        inter, hidden = spec.intermediate_size, spec.hidden_size
        self.gate_up_proj = _linear(2 * inter, hidden, False, device, dtype, quantization)
        self.down_proj = _linear(hidden, inter, False, device, dtype, quantization, all_reduce)
        plain, quantizing = _ACTIVATIONS[spec.mlp_act]
        self.act = quantizing if quantization == "fp8" else plain
        self.swiglu = spec.mlp_act == "silu"

    def forward(self, x: torch.Tensor | fp8.QuantizedActivation) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if self.swiglu and gemv_silu_and_mul_applies(x, gate_up.weight):  # small M: one launch
            return self.down_proj(gemv_silu_and_mul(x, gate_up.weight, gate_up.weight_scale))
        return self.down_proj(self.act(gate_up(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, their residual adds fused into the following RMSNorm.

    As in vLLM, a layer returns its MLP output and the residual stream *separately*: the add
    that completes the layer happens inside the next layer's input norm (or the final norm), so
    each add costs no kernel of its own.

    Norm names are the checkpoint's: Llama's post_attention_layernorm is the norm before the MLP;
    with sandwich norms (Gemma) post_attention_layernorm normalises the attention output,
    pre_feedforward_layernorm comes before the MLP and post_feedforward_layernorm after it.
    """

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        window: int | None,
        rotary: RotaryEmbedding,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str | None = None,
        all_reduce: AllReduce | None = None,
        kv_group: int = 0,
    ):
        super().__init__()
        moe = spec.is_moe_layer(layer)
        quant = quantization == "fp8"
        norm = functools.partial(RMSNorm, spec.hidden_size, spec.rms_norm_eps, device, dtype, kind=spec.norm)
        self.sandwich = spec.sandwich_norms
        self.input_layernorm = norm(quantize=quant)
        self.self_attn = Attention(spec, window, rotary, device, dtype, quantization, all_reduce, kv_group)
        # The router reads the pre-MLP norm's output in full precision.
        if self.sandwich:
            self.post_attention_layernorm = norm()
            self.pre_feedforward_layernorm = norm(quantize=quant and not moe)
            self.post_feedforward_layernorm = norm()
        else:
            self.post_attention_layernorm = norm(quantize=quant and not moe)
        if moe:
            self.mlp = SparseMoE(spec, _linear, device, dtype, quantization, all_reduce)
        else:
            self.mlp = MLP(spec, device, dtype, quantization, all_reduce)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (MLP output, residual stream); their sum is the layer's output.

        Args:
            x: the previous layer's MLP output, or the embeddings for the first layer.
            residual: the previous layer's residual stream; None for the first layer.
        """
        attn = self.self_attn
        qkv, residual = self.input_layernorm.then_project(x, residual, attn.qkv_proj)
        x = attn.attend(qkv, meta, k_cache, v_cache)
        if self.sandwich:
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        mlp = self.mlp
        if isinstance(mlp, MLP) and mlp.swiglu and gemv_silu_and_mul_applies(x, mlp.gate_up_proj.weight):
            h, residual = self.post_attention_layernorm.then_project(
                x, residual, mlp.gate_up_proj, silu_and_mul=True
            )
            return mlp.down_proj(h), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return mlp(x), residual


class CausalLM(nn.Module):
    """The decoder stack plus LM head. Parameters are allocated uninitialised; `loader` fills them.

    Parameter names (embed_tokens, layers.N.self_attn.qkv_proj, ..., norm, lm_head) are what
    `executor.loader` maps checkpoint tensors onto.

    Tensor parallelism: `spec` is the rank's local spec (`TPShard.local_spec`), `all_reduce` the
    group's, and `computes_logits=False` on ranks other than 0, whose forward then returns None.
    """

    def __init__(
        self,
        spec: ModelSpec,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str | None = None,
        all_reduce: AllReduce | None = None,
        computes_logits: bool = True,
        hybrid_kv_cache: bool = True,
    ):
        super().__init__()
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        self.spec = spec
        self.quantization = quantization
        self.kv_scales_loaded = False  # the loader sets it when the checkpoint carried KV scales
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, device, dtype, spec.embed_scale)
        # One table per distinct rotary embedding (Gemma 3: local and global), shared by its layers.
        rotaries: dict[RopeConfig, RotaryEmbedding] = {}
        for layer in range(spec.num_layers):
            rope = spec.layer_rope(layer)
            if rope not in rotaries:
                rotaries[rope] = RotaryEmbedding(rope, spec.head_dim, max_model_len, device)
        # A window that covers max_model_len masks nothing: those layers attend in full (and keep
        # the kernels' fastest path).
        windows = [w if w is not None and w < max_model_len else None for w in spec.layer_windows]
        # Which block tables each layer uses: a group per attention kind, so that sliding-window
        # layers give blocks back (executor.kv_groups); one group of every layer without the hybrid
        # KV-cache manager (the windows still apply).
        self.kv_groups = KVCacheGroups.for_layers(windows if hybrid_kv_cache else [None] * spec.num_layers)
        self.layers = nn.ModuleList(
            DecoderLayer(
                spec,
                layer,
                windows[layer],
                rotaries[spec.layer_rope(layer)],
                device,
                dtype,
                quantization,
                all_reduce,
                self.kv_groups.layer_group[layer],
            )  # fmt: skip
            for layer in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype, kind=spec.norm)
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else _param(spec.vocab_size, spec.hidden_size, device=device, dtype=dtype)
        )
        self.final_soft_cap = spec.final_soft_cap
        # Chosen once here, not tested per step: one rank runs the single-device code unchanged.
        self._head = self._logits if computes_logits else _no_logits

    def decode_read_bytes(self) -> int:
        """Bytes of the parameters a decode step reads: all of them as loaded (FP8 linears at one
        byte per element, plus their scales), but for the embedding table when the LM head is its
        own matrix, since a step reads only its tokens' rows of it (1 GB of the 8B shape's 16)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if self.lm_head is not None:
            total -= self.embed_tokens.weight.numel() * self.embed_tokens.weight.element_size()
        return total

    def set_kv_calibration(self, on: bool) -> None:
        """While on, every layer sets its KV scales from the step's keys and values (eager only)."""
        for layer in self.layers:
            layer.self_attn.calibrate_kv_scales = on

    def needs_kv_calibration(self, kv_cache_dtype: str) -> bool:
        """Whether the first real step sets the KV scales: an FP8 pool the checkpoint gave none."""
        return kv_cache_dtype == "fp8" and not self.kv_scales_loaded

    def reset_kv_scales(self) -> None:
        """Every layer's KV scales back to 1.0, as built (after a calibration on scratch data)."""
        for layer in self.layers:
            layer.self_attn.k_scale.fill_(1.0)
            layer.self_attn.v_scale.fill_(1.0)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Runs the step's tokens and returns float32 logits [len(logits_indices), vocab] (None on
        a tensor-parallel rank that does not compute them).

        Args:
            input_ids: [num_tokens] int64.
            meta: positions and paged-cache layout of the tokens.
            kv_caches: per layer (k_cache, v_cache), written in place (`KVCache.layer_caches` with
                this model's `kv_groups.layer_slot`).
            logits_indices: [num_rows] int64 rows of the batch that need logits (each sampling
                sequence's last token); the LM head runs on those rows only. None = every row
                (a decode batch, where each row samples).
            out: float32 [num_rows, vocab] to write the logits into: a CUDA graph keeps one buffer
                for all its batch sizes instead of one output per captured graph.
        """
        x, residual = self.embed_tokens(input_ids), None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, meta, k_cache, v_cache)
        return self._head(x, residual, logits_indices, out)

    def _logits(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        logits_indices: torch.Tensor | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        if self.norm.kind == "rms" and gemv_norm_applies(x, head):  # one token: one launch
            logits, _ = normed_gemv(x, residual, self.norm.weight, self.norm.eps, head, None)
        else:
            x, _ = self.norm(x, residual)
            logits = dense_matmul(x, head)
        if self.final_soft_cap is not None:  # in the model dtype, as transformers
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        if out is None:
            return logits.float()
        return out.copy_(logits)


def _no_logits(x: torch.Tensor, residual: torch.Tensor, logits_indices, out) -> None:
    """The head of a tensor-parallel rank other than 0: rank 0 alone computes logits and samples."""
    del x, residual, logits_indices, out
