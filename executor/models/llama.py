"""Llama, Mistral and Qwen2: the shared layers with their defaults (RMSNorm, SwiGLU, full rotary).

Mistral's sliding window covers every layer; Qwen2's (use_sliding_window) the layers from
max_window_layers on. Qwen2 has q/k/v biases and none on o_proj; Llama's attention_bias puts one on
all four. The checkpoints use the canonical names as they are.
"""

from __future__ import annotations

from typing import Any

from pagedserve.executor.models.common import (
    Family,
    check_activation,
    listed_windows,
    read_rope,
    rope_parameters,
    uniform_window,
)
from pagedserve.executor.spec import FULL_ATTENTION, SLIDING_ATTENTION


def _llama(hf: Any, arch: str) -> dict[str, Any]:
    check_activation(hf, arch, "hidden_act", ("silu",))
    return dict(rope=read_rope(hf, arch, rope_parameters(hf)), **uniform_window(hf.num_hidden_layers, None))


def _mistral(hf: Any, arch: str) -> dict[str, Any]:
    check_activation(hf, arch, "hidden_act", ("silu",))
    window = getattr(hf, "sliding_window", None)
    return dict(rope=read_rope(hf, arch, rope_parameters(hf)), **uniform_window(hf.num_hidden_layers, window))


def qwen_windows(hf: Any, arch: str) -> dict[str, Any]:
    """Qwen2/Qwen3: with use_sliding_window, layers >= max_window_layers slide (transformers' rule)."""
    sliding = getattr(hf, "use_sliding_window", False) and getattr(hf, "sliding_window", None)
    first = getattr(hf, "max_window_layers", 0) or 0
    # transformers 5 computes layer_types by the same rule; older releases have none.
    default = [
        SLIDING_ATTENTION if sliding and i >= first else FULL_ATTENTION for i in range(hf.num_hidden_layers)
    ]
    return listed_windows(hf, arch, hf.num_hidden_layers, default)


def _qwen2(hf: Any, arch: str) -> dict[str, Any]:
    check_activation(hf, arch, "hidden_act", ("silu",))
    return dict(
        rope=read_rope(hf, arch, rope_parameters(hf)), qkv_bias=True, o_bias=False, **qwen_windows(hf, arch)
    )


LLAMA = Family(architectures=("LlamaForCausalLM",), describe=_llama)
MISTRAL = Family(architectures=("MistralForCausalLM",), describe=_mistral)
QWEN2 = Family(architectures=("Qwen2ForCausalLM",), describe=_qwen2)
