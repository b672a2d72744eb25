"""What every family shares: the `Family` description, the common config fields, rotary parameters.

Strictness: a field the forward pass needs and the config leaves unset, or sets to something we do
not run, fails here with `UnsupportedModelError` naming the architecture and the field (and what is
supported), before any weight is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from pagedserve.executor.rotary import ROPE_TYPES
from pagedserve.executor.spec import FULL_ATTENTION, SLIDING_ATTENTION, RopeConfig, UnsupportedModelError

log = structlog.get_logger(__name__)

# Checkpoint names: after a family's `renames`, every checkpoint tensor has one of these names
# (Llama's, plus the MoE router and experts and Gemma's extra norms), which the loader maps onto ours.
CANONICAL_LAYER_MODULES = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "mlp.gate",  # the MoE router
    "mlp.experts.N.gate_proj",
    "mlp.experts.N.up_proj",
    "mlp.experts.N.down_proj",
)


def _identity(hf: Any) -> Any:
    return hf


@dataclass(frozen=True)
class Family:
    """How a family's Hugging Face configs and checkpoints map onto the shared layers.

    Attributes:
        architectures: the config.json `architectures` names it loads.
        describe: (text config, architecture) -> the ModelSpec fields the family sets beyond the
            shape every family shares (`base_fields`); raises UnsupportedModelError for a config
            field it cannot run.
        renames: (regex, replacement) pairs that take checkpoint tensor names to the canonical ones
            (`CANONICAL_LAYER_MODULES` under model.layers.N., model.embed_tokens, model.norm, lm_head).
        fused_checkpoint: the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3); the loader
            splits them into q/k/v and gate/up before anything else, so tensor parallelism and FP8
            treat them as any other checkpoint's.
        ignored_prefixes: checkpoint tensors that are not the text model's (a vision tower), skipped
            without being read.
        text_config: the text model's config inside the checkpoint's (multimodal) config.
    """

    architectures: tuple[str, ...]
    describe: Callable[[Any, str], dict[str, Any]]
    renames: tuple[tuple[str, str], ...] = ()
    fused_checkpoint: bool = False
    ignored_prefixes: tuple[str, ...] = ()
    text_config: Callable[[Any], Any] = _identity


def field(hf: Any, name: str, arch: str) -> Any:
    """hf.name, which must be set."""
    value = getattr(hf, name, None)
    if value is None:
        raise UnsupportedModelError(f"{arch}: config field {name!r} is unset")
    return value


def refuse(arch: str, name: str, value: Any, supported: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{arch}: {name}={value!r} is not supported (supported: {supported})")


def check_activation(hf: Any, arch: str, name: str, allowed: tuple[str, ...]) -> None:
    act = getattr(hf, name, None) or allowed[0]
    if act not in allowed:
        raise refuse(arch, name, act, ", ".join(allowed))


def base_fields(hf: Any, arch: str) -> dict[str, Any]:
    """The shape every family reads the same way, with the Llama traits as defaults."""
    if getattr(hf, "mlp_bias", False):
        raise refuse(arch, "mlp_bias", True, "False")
    if getattr(hf, "pretraining_tp", 1) not in (None, 1):
        log.warning("ignoring pretraining_tp", pretraining_tp=hf.pretraining_tp)
    num_heads = field(hf, "num_attention_heads", arch)
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"{arch}: num_attention_heads {num_heads} not a multiple of kv heads {num_kv_heads}"
        )
    hidden = field(hf, "hidden_size", arch)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return dict(
        vocab_size=field(hf, "vocab_size", arch),
        hidden_size=hidden,
        intermediate_size=field(hf, "intermediate_size", arch),
        num_layers=field(hf, "num_hidden_layers", arch),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=getattr(hf, "head_dim", None) or hidden // num_heads,
        rms_norm_eps=float(field(hf, "rms_norm_eps", arch)),
        max_position_embeddings=int(field(hf, "max_position_embeddings", arch)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
    )


def uniform_window(num_layers: int, window: int | None) -> dict[str, Any]:
    """Every layer sliding with `window` (Mistral, Mixtral, Phi-3, Qwen3-MoE), or none."""
    kind = SLIDING_ATTENTION if window else FULL_ATTENTION
    return dict(sliding_window=int(window) if window else None, layer_types=(kind,) * num_layers)


def listed_windows(hf: Any, arch: str, num_layers: int, default: list[str]) -> dict[str, Any]:
    """Per-layer windows from `layer_types` (transformers 5 sets it for every family that has it),
    else `default` (the rule older transformers applied)."""
    types = tuple(getattr(hf, "layer_types", None) or default)
    if len(types) != num_layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise refuse(
            arch, "layer_types", list(types), f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} per layer"
        )
    window = getattr(hf, "sliding_window", None)
    if SLIDING_ATTENTION not in types:
        return dict(sliding_window=None, layer_types=types)
    if not window:
        raise UnsupportedModelError(
            f"{arch}: config field 'sliding_window' is unset but layer_types has sliding layers"
        )
    return dict(sliding_window=int(window), layer_types=types)


def rope_parameters(hf: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rotary parameters as one flat dict: transformers >= 5's `rope_parameters` (per layer type
    for Gemma 3), or older releases' `rope_theta` + `rope_scaling` ("type" or "rope_type")."""
    params = getattr(hf, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    if not params or "rope_theta" not in params:
        legacy = dict(getattr(hf, "rope_scaling", None) or {})
        params = {**legacy, **params}
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return params


def read_rope(hf: Any, arch: str, params: dict[str, Any], partial_ok: bool = False) -> RopeConfig:
    """A RopeConfig from flat rotary parameters, or a clear refusal."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = {"su": "longrope", "dynamic": "default"}.get(rope_type, rope_type)
    if params.get("rope_type", params.get("type")) == "dynamic":
        log.info("dynamic NTK rope is the default rope within max_position_embeddings", architecture=arch)
    if rope_type not in ROPE_TYPES:
        raise refuse(arch, "rope type", rope_type, ", ".join((*ROPE_TYPES, "dynamic")))
    partial = float(params.get("partial_rotary_factor") or getattr(hf, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0 and not partial_ok:
        raise refuse(arch, "partial_rotary_factor", partial, "1.0 for this architecture")
    theta = float(params["rope_theta"])
    max_pos = int(hf.max_position_embeddings)
    original = int(params.get("original_max_position_embeddings") or max_pos)
    rope = dict(theta=theta, rope_type=rope_type, partial_rotary_factor=partial)
    if rope_type == "linear":
        rope.update(factor=float(params["factor"]))
    elif rope_type == "llama3":
        rope.update(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    elif rope_type == "yarn":
        rope.update(_yarn_fields(params, max_pos, original))
    elif rope_type == "longrope":
        rope.update(_longrope_fields(hf, arch, params, max_pos, partial))
    return RopeConfig(**rope)


def _yarn_fields(params: dict[str, Any], max_pos: int, original: int) -> dict[str, Any]:
    """transformers' `_compute_yarn_parameters` defaults, its attention factor included."""
    factor = float(params.get("factor") or max_pos / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return dict(
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
    )


def _longrope_fields(
    hf: Any, arch: str, params: dict[str, Any], max_pos: int, partial: float
) -> dict[str, Any]:
    """transformers' `_compute_longrope_parameters`: Phi-3 keeps the pretraining length outside
    the rope parameters (original_max_position_embeddings), which takes priority."""
    original = int(
        getattr(hf, "original_max_position_embeddings", None)
        or params.get("original_max_position_embeddings")
        or max_pos
    )
    short, long = params.get("short_factor"), params.get("long_factor")
    half = int(hf.head_dim * partial) // 2 if getattr(hf, "head_dim", None) else None
    half = half or int(hf.hidden_size // hf.num_attention_heads * partial) // 2
    for name, value in (("short_factor", short), ("long_factor", long)):
        if not value or len(value) != half:
            raise UnsupportedModelError(
                f"{arch}: longrope needs {name} with {half} values (rotary_dim / 2), got {value!r}"
            )
    factor = float(params.get("factor") or max_pos / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        short_factor=tuple(float(v) for v in short),
        long_factor=tuple(float(v) for v in long),
    )
