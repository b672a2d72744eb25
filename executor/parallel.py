"""Tensor parallelism, the shard math: which heads and rows of each weight a rank holds.

Megatron-style, as in vLLM: within a decoder layer the projections that *produce* heads or MLP
rows are column-parallel (each rank computes its slice of q, k, v, gate and up, with no
communication), the ones that *consume* them are row-parallel (o_proj and down_proj multiply their
slice of the input by the matching columns and the partial sums are all-reduced: one all-reduce
after attention, one after the MLP). So a layer's input and output are whole, and equal, on every
rank; the embeddings, norms and the LM head are replicated (the simplest: they are a few percent of
an 8B model's weights, and the final hidden state is whole on every rank anyway).

Splits, for N ranks (`TPShard(rank, size)`):
* query heads: rank r holds heads [r*H/N, (r+1)*H/N) (H must be a multiple of N);
* KV heads: with K >= N, [r*K/N, (r+1)*K/N) (K a multiple of N); with K < N (N a multiple of K),
  each rank holds the one KV head its query heads use, head r*K//N: KV heads are replicated N/K
  times, as in vLLM. Either way a rank's local query head i uses its local KV head i // (H/K), the
  GQA grouping the attention kernels apply;
* MLP rows: [r*I/N, (r+1)*I/N) of gate and of up (re-fused per rank), the same columns of down;
* experts (`executor.moe`): the same split of each expert's intermediate dimension (its gate and
  up rows of w13, the same columns of w2), so each rank's combined output is a partial sum,
  all-reduced after the combine; the router is replicated (every rank routes alike);
* biases and FP8 per-output-channel weight scales go with their rows: split for q/k/v/gate/up,
  whole for o_proj/down_proj, whose bias is added once, after the all-reduce.

This module only does arithmetic on shapes and checkpoint tensors; the process group is
`executor.tp_group`, the loader calls `TPShard.narrow` per checkpoint tensor (by its canonical
name, `executor.models.common`: after a family's renames and the split of fused checkpoint tensors).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from pagedserve.executor.spec import ModelSpec, UnsupportedModelError

_LAYER_TENSOR = re.compile(r"^model\.layers\.\d+\.(.+)\.([^.]+)$")
_EXPERT_INDEX = re.compile(r"^mlp\.experts\.\d+\.")
_COLUMN_PARALLEL = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.experts.gate_proj",
    "mlp.experts.up_proj",
)
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj", "mlp.experts.down_proj")
# Tensors of a column-parallel module that are split by rows with the weight; others (an FP8
# checkpoint's input_scale, the KV cache's output_scale) are per tensor and stay whole.
_ROW_SLICED_KINDS = ("weight", "bias", "weight_scale")


class TensorParallelError(UnsupportedModelError):
    """--tensor-parallel-size does not fit the model (or the machine); the message says why."""


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """Fails with a one-line reason when `spec` cannot be split over `size` ranks."""
    if size < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be at least 1, got {size}")
    problems = []
    if spec.num_heads % size:
        problems.append(f"num_attention_heads {spec.num_heads} is not divisible by it")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads {kv} neither divides it nor is divisible by it")
    if spec.intermediate_size % size:
        problems.append(f"intermediate_size {spec.intermediate_size} is not divisible by it")
    if spec.moe is not None and spec.moe.intermediate_size % size:
        problems.append(f"the experts' intermediate size {spec.moe.intermediate_size} is not divisible by it")
    if problems:
        raise TensorParallelError(
            f"--tensor-parallel-size {size} does not fit {spec.name}: " + "; ".join(problems)
        )


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of a tensor-parallel group of `size` ranks: what it holds of a model."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    def q_heads(self, spec: ModelSpec) -> range:
        per_rank = spec.num_heads // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self, spec: ModelSpec) -> range:
        """This rank's KV heads (one, shared with other ranks, when num_kv_heads < size)."""
        kv = spec.num_kv_heads
        if kv >= self.size:
            per_rank = kv // self.size
            return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        head = self.rank * kv // self.size
        return range(head, head + 1)

    def mlp_rows(self, spec: ModelSpec) -> range:
        per_rank = spec.intermediate_size // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def expert_rows(self, spec: ModelSpec) -> range:
        """This rank's rows of each expert's intermediate dimension."""
        assert spec.moe is not None
        per_rank = spec.moe.intermediate_size // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The shape this rank's modules (and its KV pool) have: its heads, MLP and expert rows."""
        check_tensor_parallel(spec, self.size)
        moe = spec.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=len(self.expert_rows(spec)))
        return dataclasses.replace(
            spec,
            num_heads=len(self.q_heads(spec)),
            num_kv_heads=len(self.kv_heads(spec)),
            intermediate_size=len(self.mlp_rows(spec)),
            moe=moe,
        )

    def _rows(self, spec: ModelSpec, module: str) -> range:
        """Output rows (of the unfused checkpoint tensor) a column-parallel module keeps, or the
        input columns a row-parallel one keeps."""
        d = spec.head_dim
        if module in ("self_attn.q_proj", "self_attn.o_proj"):
            heads = self.q_heads(spec)
            return range(heads.start * d, heads.stop * d)
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            heads = self.kv_heads(spec)
            return range(heads.start * d, heads.stop * d)
        if module.startswith("mlp.experts."):
            return self.expert_rows(spec)
        return self.mlp_rows(spec)

    def narrow(self, spec: ModelSpec, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (a view; the tensor itself when replicated).

        Column-parallel weights, biases and per-channel scales lose rows; row-parallel weights lose
        columns (their bias and scales, per output row, stay whole); everything else is replicated.
        `name` is canonical (`executor.models.common`).
        """
        match = _LAYER_TENSOR.match(name)
        if match is None:
            return tensor
        module, kind = match.groups()
        module = _EXPERT_INDEX.sub("mlp.experts.", module)  # every expert is split alike
        if module in _COLUMN_PARALLEL and kind in _ROW_SLICED_KINDS:
            if kind == "weight_scale" and tensor.numel() == 1:
                return tensor  # a per-tensor FP8 scale
            rows = self._rows(spec, module)
            return tensor.narrow(0, rows.start, len(rows))
        if module in _ROW_PARALLEL and kind == "weight":
            cols = self._rows(spec, module)
            return tensor.narrow(1, cols.start, len(cols))
        return tensor


__all__ = ["TPShard", "TensorParallelError", "check_tensor_parallel"]
