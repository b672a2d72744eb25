"""What the executor knows of a model: its shape and its family's traits, independent of transformers.

`executor.models` reads a Hugging Face config into a `ModelSpec` (one small description per
family), `executor.model` builds the forward pass from it, `executor.parallel` splits it over ranks
and the KV pool is sized from it. Every field is plain data, so a spec is cheap to compare, hash and
copy with `dataclasses.replace` (a tensor-parallel rank's local spec).

Per-layer attention: `layer_types[i]` is "full_attention" or "sliding_attention" (Hugging Face's
names); `layer_windows` gives each layer's window (None for full attention). Sliding layers share one
window (`sliding_window`) in every family supported; Gemma 3's sliding layers also have a rotary
embedding of their own (`local_rope`).
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
NORMS = ("rms", "gemma")  # w * x / rms(x) (Llama), or (1 + w) * x / rms(x) in float32 (Gemma)
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU, GeGLU with tanh-approximated GELU (Gemma)


class UnsupportedModelError(ValueError):
    """The checkpoint is not one this executor can run (architecture, activation, rope type...)."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, as `executor.rotary` computes them.

    `rope_type` is "default", "linear", "llama3", "yarn" or "longrope" (see `executor.rotary`);
    `attention_factor` multiplies cos and sin (YaRN's and LongRoPE's attention scaling, 1.0 for the
    others); `partial_rotary_factor` < 1 rotates only the first part of each head (Phi-4-mini).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    attention_factor: float = 1.0
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    short_factor: tuple[float, ...] = ()  # longrope: positions < original_max_position_embeddings
    long_factor: tuple[float, ...] = ()  # longrope: positions from there on

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dimensions of each head are rotated."""
        return int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class MoESpec:
    """Routed experts (Mixtral, Qwen3-MoE): each token goes through its `top_k` experts.

    Attributes:
        num_experts: experts per MoE layer.
        top_k: experts per token.
        intermediate_size: each expert's SwiGLU width (a dense layer's is ModelSpec.intermediate_size).
        renormalize: the top-k routing weights are divided by their sum (Mixtral always; Qwen3-MoE
            with norm_topk_prob); otherwise they stay the softmax's over all experts.
        layers: the layers whose MLP is the experts; the others have a dense MLP.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    layers: tuple[int, ...]


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only model and its family's traits.

    The traits after `eos_token_ids` default to Llama's; a family description
    (`executor.models`) sets the ones it differs in.

    Attributes (the less obvious ones):
        sliding_window: the window of the sliding-attention layers (None when there are none).
        layer_types: per layer, "full_attention" or "sliding_attention".
        local_rope: the sliding layers' rotary embedding when it differs from `rope` (Gemma 3).
        norm: "rms" or "gemma" (see NORMS), for every RMSNorm of the model.
        sandwich_norms: norms after attention and after the MLP too (Gemma: post_attention_layernorm
            then pre_feedforward_layernorm before the MLP, post_feedforward_layernorm after it).
        qk_norm: an RMSNorm over each query and key head before the rotary embedding (Qwen3, Gemma 3).
        mlp_act: "silu" or "gelu_tanh" (see MLP_ACTIVATIONS).
        embed_scale: the embeddings are multiplied by this (Gemma: sqrt(hidden_size)), rounded to
            the model dtype first as Hugging Face does.
        attn_scale: the softmax scale; None is head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
        attn_soft_cap, final_soft_cap: scores, or final logits, become cap * tanh(x / cap) (Gemma 2).
        moe: the routed experts, None for a dense model.
    """

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]
    eos_token_ids: tuple[int, ...]
    local_rope: RopeConfig | None = None
    norm: str = "rms"
    sandwich_norms: bool = False
    qk_norm: bool = False
    mlp_act: str = "silu"
    embed_scale: float | None = None
    attn_scale: float | None = None
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    moe: MoESpec | None = None

    def __post_init__(self) -> None:
        problems = []
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            problems.append(f"layer_types must give one of {LAYER_TYPES} per layer, got {self.layer_types}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            problems.append("sliding-attention layers need sliding_window")
        if self.norm not in NORMS:
            problems.append(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.mlp_act not in MLP_ACTIVATIONS:
            problems.append(f"mlp_act must be one of {MLP_ACTIVATIONS}, got {self.mlp_act!r}")
        if self.moe is not None and not set(self.moe.layers) <= set(range(self.num_layers)):
            problems.append(f"MoE layers {self.moe.layers} outside the {self.num_layers} layers")
        if problems:
            raise UnsupportedModelError(f"{self.architecture} ({self.name}): " + "; ".join(problems))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window; None for a full-attention layer."""
        return tuple(self.sliding_window if t == SLIDING_ATTENTION else None for t in self.layer_types)

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rotary embedding of layer `layer`."""
        if self.local_rope is not None and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.local_rope
        return self.rope

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers
