"""Mixtral: Mistral's attention (its sliding window, if set, on every layer) and routed experts on
every layer, the top-k routing weights always renormalized.

Checkpoint names: block_sparse_moe.gate is the router, block_sparse_moe.experts.N.w1 / w3 / w2
each expert's gate / up / down projection.
"""

from __future__ import annotations

from typing import Any

from pagedserve.executor.models.common import (
    Family,
    check_activation,
    field,
    read_rope,
    rope_parameters,
    uniform_window,
)
from pagedserve.executor.spec import MoESpec


def _mixtral(hf: Any, arch: str) -> dict[str, Any]:
    check_activation(hf, arch, "hidden_act", ("silu",))
    moe = MoESpec(
        num_experts=int(field(hf, "num_local_experts", arch)),
        top_k=int(field(hf, "num_experts_per_tok", arch)),
        intermediate_size=int(hf.intermediate_size),
        renormalize=True,
        layers=tuple(range(hf.num_hidden_layers)),
    )
    window = getattr(hf, "sliding_window", None)
    return dict(
        rope=read_rope(hf, arch, rope_parameters(hf)),
        moe=moe,
        **uniform_window(hf.num_hidden_layers, window),
    )


MIXTRAL = Family(
    architectures=("MixtralForCausalLM",),
    describe=_mixtral,
    renames=(
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    ),
)
