"""Phi-3 (and Phi-4-mini): the Llama layers with q/k/v and gate/up fused in the checkpoint
(self_attn.qkv_proj, mlp.gate_up_proj; the loader splits them), LongRoPE scaling (short and long
factors, see `executor.rotary`), partial rotary embeddings (partial_rotary_factor, Phi-4-mini), and
the sliding window, if set, on every layer (Phi-3-mini-4k's 2047).
"""

from __future__ import annotations

from typing import Any

from pagedserve.executor.models.common import (
    Family,
    check_activation,
    read_rope,
    refuse,
    rope_parameters,
    uniform_window,
)


def _phi3(hf: Any, arch: str) -> dict[str, Any]:
    check_activation(hf, arch, "hidden_act", ("silu",))
    rope = read_rope(hf, arch, rope_parameters(hf), partial_ok=True)
    if rope.rope_type not in ("default", "longrope"):  # what transformers' Phi3Config accepts
        raise refuse(arch, "rope type", rope.rope_type, "default, longrope")
    window = getattr(hf, "sliding_window", None)
    return dict(rope=rope, **uniform_window(hf.num_hidden_layers, window))


PHI3 = Family(architectures=("Phi3ForCausalLM",), describe=_phi3, fused_checkpoint=True)
