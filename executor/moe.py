"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router in the model, the experts in one kernel.

Routing is the family's (`ModelSpec.moe`): router logits in the model dtype, a softmax over all
experts in float32, the top k, and, where the checkpoint says so, the k weights divided by their
sum (Mixtral always; Qwen3-MoE with norm_topk_prob). All tensor ops, no host sync, so the step
stays capturable in a CUDA graph. The experts run in `kernels.fused_moe` from stacked weights:
`w13` [E, 2I, H] (each expert's gate rows then up rows, like the dense gate_up_proj) and `w2`
[E, H, I]; the loader stacks the checkpoint's per-expert tensors into them one at a time.

`--quantization fp8`: the experts' weights are e4m3 with one float32 scale per output row
(`weight_scale` [E, rows]), quantized at load as the dense projections are; the router stays in the
model dtype. Tensor parallelism: each rank holds its slice of every expert's intermediate dimension
(gate and up rows, the same columns of down), so its combined output is a partial sum, all-reduced
here as the dense MLP's row-parallel down_proj is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.executor.spec import ModelSpec
from pagedserve.kernels import fp8


class ExpertWeights(nn.Module):
    """One stacked projection of all experts: `weight` [E, rows, cols] (and FP8's `weight_scale`)."""

    def __init__(
        self, experts: int, rows: int, cols: int, device: torch.device, dtype: torch.dtype, quantized: bool
    ) -> None:
        super().__init__()
        # Uninitialised: the loader fills every expert.
        weight_dtype = fp8.FP8_DTYPE if quantized else dtype
        self.weight = nn.Parameter(torch.empty(experts, rows, cols, device=device, dtype=weight_dtype), False)
        self.weight_scale = (
            nn.Parameter(torch.empty(experts, rows, device=device, dtype=torch.float32), False)
            if quantized
            else None
        )


class SparseMoE(nn.Module):
    """Router + routed experts. Parameters: gate.weight [E, H] (the router), experts.w13, experts.w2."""

    def __init__(
        self,
        spec: ModelSpec,
        linear: Callable[..., nn.Module],
        device: torch.device,
        dtype: torch.dtype,
        quantization: str | None,
        all_reduce: Callable[[torch.Tensor], object] | None,
    ) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = linear(moe.num_experts, spec.hidden_size, False, device, dtype, None)  # never FP8
        quantized = quantization == "fp8"
        inter, hidden = moe.intermediate_size, spec.hidden_size
        self.experts = nn.Module()
        self.experts.w13 = ExpertWeights(moe.num_experts, 2 * inter, hidden, device, dtype, quantized)
        self.experts.w2 = ExpertWeights(moe.num_experts, hidden, inter, device, dtype, quantized)
        self.all_reduce = all_reduce

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k] float32, top-k expert ids [T, k]) of each token."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        w13, w2 = self.experts.w13, self.experts.w2
        out = kernels.fused_moe(x, w13.weight, w2.weight, weights, ids, w13.weight_scale, w2.weight_scale)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out
