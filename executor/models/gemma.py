"""Gemma 2 and Gemma 3 (text): the shared layers with Gemma's traits.

* RMSNorm with (1 + weight), in float32 (`kernels.layers.gemma_rms_norm`), sandwich norms (after
  attention and after the MLP too), GeGLU with the tanh GELU, embeddings times sqrt(hidden_size)
  (rounded to the model dtype), the softmax scale query_pre_attn_scalar ** -0.5, tied embeddings;
* Gemma 2: score soft-cap (attn_logit_softcapping) and final logit soft-cap, sliding and global
  layers alternating (layer_types);
* Gemma 3: q/k norms, 5 sliding layers per global one (layer_types, or sliding_window_pattern in
  older configs), a rotary embedding per layer type: the sliding layers' base is
  rope_local_base_freq, the global layers' rope_theta with Gemma 3's rope scaling (linear, factor 8
  on the 4B and larger). Its attn_logit_softcapping is refused: transformers' Gemma 3 never
  applies it, so what it should do is undefined.
* Gemma3ForConditionalGeneration checkpoints: the text model's weights (language_model.*) load as
  Gemma3ForCausalLM's; the vision tower and projector are skipped (text prompts only).
"""

from __future__ import annotations

from typing import Any

from pagedserve.executor.models.common import (
    Family,
    check_activation,
    field,
    listed_windows,
    read_rope,
    refuse,
    rope_parameters,
)
from pagedserve.executor.spec import FULL_ATTENTION, SLIDING_ATTENTION, UnsupportedModelError


def _gemma_traits(hf: Any, arch: str) -> dict[str, Any]:
    check_activation(hf, arch, "hidden_activation", ("gelu_pytorch_tanh",))
    if getattr(hf, "use_bidirectional_attention", False):
        raise refuse(arch, "use_bidirectional_attention", True, "False (causal attention)")
    return dict(
        norm="gemma",
        sandwich_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=float(hf.hidden_size) ** 0.5,
        attn_scale=float(field(hf, "query_pre_attn_scalar", arch)) ** -0.5,
        final_soft_cap=getattr(hf, "final_logit_softcapping", None),
    )


def _gemma2(hf: Any, arch: str) -> dict[str, Any]:
    n = hf.num_hidden_layers
    default = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(n)]
    return dict(
        rope=read_rope(hf, arch, rope_parameters(hf)),
        attn_soft_cap=getattr(hf, "attn_logit_softcapping", None),
        **_gemma_traits(hf, arch),
        **listed_windows(hf, arch, n, default),
    )


def _gemma3_ropes(hf: Any, arch: str) -> dict[str, Any]:
    params = getattr(hf, "rope_parameters", None) or {}
    if isinstance(params.get(FULL_ATTENTION), dict):  # transformers >= 5: one dict per layer type
        full, local = rope_parameters(hf, FULL_ATTENTION), rope_parameters(hf, SLIDING_ATTENTION)
    else:  # older releases: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq
        full = rope_parameters(hf)
        local = {"rope_type": "default", "rope_theta": field(hf, "rope_local_base_freq", arch)}
    return dict(rope=read_rope(hf, arch, full), local_rope=read_rope(hf, arch, local))


def _gemma3(hf: Any, arch: str) -> dict[str, Any]:
    if getattr(hf, "attn_logit_softcapping", None) is not None:
        raise refuse(
            arch, "attn_logit_softcapping", hf.attn_logit_softcapping, "None (transformers ignores it)"
        )
    n = hf.num_hidden_layers
    pattern = getattr(hf, "sliding_window_pattern", None) or getattr(hf, "_sliding_window_pattern", 6)
    default = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]
    return dict(
        qk_norm=True,
        **_gemma3_ropes(hf, arch),
        **_gemma_traits(hf, arch),
        **listed_windows(hf, arch, n, default),
    )


def _text_config(hf: Any) -> Any:
    text = getattr(hf, "text_config", None)
    if text is None:
        raise UnsupportedModelError("Gemma3ForConditionalGeneration: the config has no text_config")
    return text


GEMMA2 = Family(architectures=("Gemma2ForCausalLM",), describe=_gemma2)
GEMMA3 = Family(architectures=("Gemma3ForCausalLM",), describe=_gemma3)
GEMMA3_MULTIMODAL = Family(
    architectures=("Gemma3ForConditionalGeneration",),
    describe=_gemma3,
    renames=(
        (r"^language_model\.model\.", "model."),
        (r"^model\.language_model\.", "model."),
        (r"^language_model\.lm_head\.", "lm_head."),
    ),
    ignored_prefixes=(
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    ),
    text_config=_text_config,
)
