"""Rotary position embeddings: the frequencies of each rope type, and cos/sin tables by position.

Each type follows transformers' `modeling_rope_utils` (the reference our greedy tokens are checked
against), with the table computed once up to max_model_len:
* "default": theta ** (-2i / d);
* "linear": frequencies divided by `factor`;
* "llama3": long wavelengths slowed by `factor`, short ones kept, the band between interpolated;
* "yarn": interpolated and extrapolated frequencies blended over a ramp of dimensions, cos and sin
  multiplied by the attention factor;
* "longrope" (Phi-3): per-dimension factors, `short_factor` for positions below
  original_max_position_embeddings and `long_factor` from there on, cos and sin multiplied by the
  attention factor. Each position has its own, so a cached key never changes, as in vLLM (which
  picks one set per batch). transformers agrees token for token while a sequence fits within
  original_max_position_embeddings, and its forward with a KV cache agrees past it too; its
  `generate`, though, recomputes the whole sequence with the long factors once it grows past that
  length (Phi3ForCausalLM.prepare_inputs_for_generation), which a paged cache cannot do without
  recomputing every such sequence's KV, so greedy tokens past that length may differ from it;
* "dynamic" NTK is "default" within max_position_embeddings (transformers rescales only beyond it,
  which `resolve_max_model_len` never allows), so the loader maps it to "default".

Partial rotary (`partial_rotary_factor` < 1, Phi-4-mini): only the first rotary_dim dimensions of
each head are rotated, the rest pass through.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.executor.spec import RopeConfig
from pagedserve.kernels import layers

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    # As in Meta's reference and transformers' `_compute_llama3_parameters`.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    # transformers' `_compute_yarn_parameters`, step for step.
    base, factor = rope.theta, rope.factor

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _longrope(rope: RopeConfig, dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] (float32) of every type but "longrope" (two sets, see
    `rope_tables`)."""
    dim = rope.rotary_dim(head_dim)
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    inv_freq = _default_inv_freq(rope.theta, dim)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq)
    if rope.rope_type != "default":
        raise ValueError(f"rope type {rope.rope_type!r} has no single set of frequencies")
    return inv_freq


def rope_tables(rope: RopeConfig, head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, rotary_dim / 2] (float32, on the CPU) by position."""
    positions = torch.arange(max_len, dtype=torch.float32)
    if rope.rope_type == "longrope":
        dim = rope.rotary_dim(head_dim)
        split = min(max_len, rope.original_max_position_embeddings)
        freqs = torch.cat(
            [
                torch.outer(positions[:split], _longrope(rope, dim, rope.short_factor)),
                torch.outer(positions[split:], _longrope(rope, dim, rope.long_factor)),
            ]
        )
    else:
        freqs = torch.outer(positions, rope_inv_freq(rope, head_dim))
    cos, sin = freqs.cos(), freqs.sin()
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos, sin


class RotaryEmbedding(nn.Module):
    """cos/sin precomputed up to max_model_len, gathered by position (neox / rotate-half layout)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int, device: torch.device) -> None:
        super().__init__()
        self.rotary_dim = rope.rotary_dim(head_dim)
        self.partial = self.rotary_dim != head_dim
        cos, sin = rope_tables(rope, head_dim, max_len)
        self.register_buffer("cos", cos.to(device), persistent=False)  # [max_len, rotary_dim / 2]
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q [num_tokens, heads, head_dim] and k [num_tokens, kv_heads, head_dim] in place."""
        if self.partial:
            q, k = q[..., : self.rotary_dim], k[..., : self.rotary_dim]
        layers.rotary_embedding(positions, q, k, self.cos, self.sin)
