"""Tiny random-weight models of every supported family (built from the transformers config classes,
saved in their checkpoint layouts), shared by the in-process and the end-to-end family tests.

Windows are tiny (12-24 tokens) so that prompts of a few dozen tokens cross them; every 1-D weight
(norms, biases) is perturbed so that each one matters.
"""

from __future__ import annotations

from pathlib import Path

from pagedserve.tiny_model import TinyModelSpec, write_tiny_model

SLIDING, FULL = "sliding_attention", "full_attention"
LONGROPE_ORIGINAL = 64  # Phi-3's original_max_position_embeddings here: generations cross it


def _phi3_longrope() -> dict:
    half = 6  # rotary_dim / 2: head_dim 16 * partial_rotary_factor 0.75 = 12 rotated dimensions
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.5 + 0.5 * i for i in range(half)],
        "partial_rotary_factor": 0.75,
    }


FAMILY_SPECS: dict[str, TinyModelSpec] = {
    "qwen3": TinyModelSpec(
        model_type="qwen3",
        num_hidden_layers=3,
        head_dim=16,  # Qwen3Config's default is 128
        seed=11,
        perturb_vectors=True,
        # Layers from max_window_layers on slide (transformers' rule): layer 0 full, 1-2 sliding.
        config=dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    "qwen3_moe": TinyModelSpec(
        model_type="qwen3_moe",
        num_hidden_layers=3,
        head_dim=16,
        seed=12,
        perturb_vectors=True,
        # Experts on layers 0 and 2 (mlp_only_layers makes 1 dense); top-2 of 8, not renormalized.
        config=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
        ),
    ),
    "mixtral": TinyModelSpec(
        model_type="mixtral",
        seed=13,
        perturb_vectors=True,
        intermediate_size=32,
        config=dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24),
    ),
    "gemma2": TinyModelSpec(
        model_type="gemma2",
        num_hidden_layers=3,
        head_dim=16,
        tie_word_embeddings=True,
        seed=14,
        perturb_vectors=True,
        config=dict(
            sliding_window=16,
            layer_types=[SLIDING, FULL, SLIDING],
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
            pad_token_id=0,
        ),
    ),
    "gemma3": TinyModelSpec(
        model_type="gemma3_text",
        num_hidden_layers=3,
        head_dim=16,
        tie_word_embeddings=True,
        seed=15,
        perturb_vectors=True,
        config=dict(
            sliding_window=12,
            layer_types=[SLIDING, SLIDING, FULL],
            query_pre_attn_scalar=16,
            final_logit_softcapping=None,
            pad_token_id=0,
            # Global layers: their own base and Gemma 3's linear scaling; local layers: base 10k.
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "phi3": TinyModelSpec(
        model_type="phi3",
        max_position_embeddings=256,
        seed=16,
        perturb_vectors=True,
        config=dict(
            sliding_window=20,
            original_max_position_embeddings=LONGROPE_ORIGINAL,
            rope_parameters=_phi3_longrope(),
            pad_token_id=0,
        ),
    ),
    "mistral": TinyModelSpec(
        model_type="mistral", seed=17, perturb_vectors=True, config=dict(sliding_window=16)
    ),
    "qwen2": TinyModelSpec(
        model_type="qwen2",
        num_hidden_layers=3,
        seed=18,
        perturb_vectors=True,
        config=dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),
    ),
}


def write_family_model(name: str, directory: Path) -> Path:
    return write_tiny_model(directory, FAMILY_SPECS[name])
