"""Qwen3 and Qwen3-MoE: the Llama layers plus an RMSNorm over each query and key head (q_norm,
k_norm) before the rotary embedding.

Qwen3-MoE's MLP is routed experts (no shared expert) on the layers `decoder_sparse_step` selects
and `mlp_only_layers` does not exclude, a dense SwiGLU of intermediate_size on the others; the top-k
routing weights are renormalized when norm_topk_prob is set. Its checkpoint names are canonical:
mlp.gate (the router) and mlp.experts.N.{gate,up,down}_proj.
"""

from __future__ import annotations

from typing import Any

from pagedserve.executor.models.common import (
    Family,
    check_activation,
    field,
    read_rope,
    refuse,
    rope_parameters,
    uniform_window,
)
from pagedserve.executor.models.llama import qwen_windows
from pagedserve.executor.spec import MoESpec


def _qwen3(hf: Any, arch: str) -> dict[str, Any]:
    check_activation(hf, arch, "hidden_act", ("silu",))
    return dict(rope=read_rope(hf, arch, rope_parameters(hf)), qk_norm=True, **qwen_windows(hf, arch))


def _qwen3_moe(hf: Any, arch: str) -> dict[str, Any]:
    check_activation(hf, arch, "hidden_act", ("silu",))
    if getattr(hf, "shared_expert_intermediate_size", 0):
        raise refuse(
            arch,
            "shared_expert_intermediate_size",
            hf.shared_expert_intermediate_size,
            "0 (no shared expert)",
        )
    num_experts = int(field(hf, "num_experts", arch))
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    layers = tuple(i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    moe = MoESpec(
        num_experts=num_experts,
        top_k=int(field(hf, "num_experts_per_tok", arch)),
        intermediate_size=int(field(hf, "moe_intermediate_size", arch)),
        renormalize=bool(getattr(hf, "norm_topk_prob", False)),
        layers=layers if num_experts > 0 else (),
    )
    # transformers applies Qwen3-MoE's window (use_sliding_window) to every layer.
    window = hf.sliding_window if getattr(hf, "use_sliding_window", False) else None
    return dict(
        rope=read_rope(hf, arch, rope_parameters(hf)),
        qk_norm=True,
        moe=moe,
        **uniform_window(hf.num_hidden_layers, window),
    )


QWEN3 = Family(architectures=("Qwen3ForCausalLM",), describe=_qwen3)
QWEN3_MOE = Family(architectures=("Qwen3MoeForCausalLM",), describe=_qwen3_moe)
