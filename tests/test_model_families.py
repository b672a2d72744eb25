"""Every supported family in process, through the real loader, against Hugging Face transformers.

Prompt logits equal transformers' (float32, eager attention) on tiny random models whose prompts are
longer than their sliding windows; the rotary tables equal transformers' for every rope type; the
experts and Phi-3's fused tensors shard over tensor-parallel ranks and the experts quantize to FP8
per row; Gemma 3's multimodal checkpoints load their text model; and what we cannot run is refused
at start with the architecture or the field named. Greedy generation through the real services is
tests/test_model_families_e2e.py.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from pagedserve.executor.kv_cache import KVCache, KVCacheLayout
from pagedserve.executor.loader import UnsupportedModelError, load_model_spec, load_weights
from pagedserve.executor.model import CausalLM
from pagedserve.executor.parallel import TPShard
from pagedserve.executor.rotary import rope_tables
from pagedserve.executor.step_inputs import build_step_inputs
from tests.families import FAMILY_SPECS, FULL, LONGROPE_ORIGINAL, SLIDING, write_family_model

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")
MAX_LEN = 256


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return {name: write_family_model(name, tmp_path_factory.mktemp(name)) for name in FAMILY_SPECS}


def _load(model_dir, quantization=None, shard: TPShard | None = None) -> CausalLM:
    spec = load_model_spec(model_dir)
    local = spec if shard is None else shard.local_spec(spec)
    all_reduce = None if shard is None else (lambda t: None)
    # One block table for every layer: these tests hand one table to the forward pass (the KV-cache
    # groups of sliding-window models are tested through the runner and the services).
    model = CausalLM(
        local, MAX_LEN, CPU, torch.float32, quantization, all_reduce=all_reduce, hybrid_kv_cache=False
    )
    load_weights(model, spec, model_dir, shard)
    return model


def _prompt_logits(model: CausalLM, prompt: list[int]) -> torch.Tensor:
    """One prefill over a shuffled block table (block size 8)."""
    spec = model.spec
    kv = KVCache(
        KVCacheLayout(spec.num_layers, 8, spec.num_kv_heads, spec.head_dim, torch.float32), 40, 0, CPU
    )
    blocks = [(7 * i + 3) % 40 for i in range(-(-len(prompt) // 8))]
    inputs = build_step_inputs([prompt], [0], [blocks], [True], 8, CPU)
    return model(inputs.input_ids, inputs.meta, kv.layer_caches(), torch.arange(len(prompt)))


def _hf(model_dir, cls=None):
    cls = cls or transformers.AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(FAMILY_SPECS))
def test_prompt_logits_match_hugging_face_past_the_window(name, family_dirs):
    model_dir = family_dirs[name]
    model, hf = _load(model_dir), _hf(model_dir)
    spec = model.spec
    # Phi-3's prompt stays within its LongRoPE original length (see executor.rotary).
    prompt = _random_prompt(LONGROPE_ORIGINAL - 4 if name == "phi3" else 70, seed=len(name))
    if spec.sliding_window is not None:
        assert len(prompt) > 2 * spec.sliding_window
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prompt_logits(model, prompt), expected, atol=2e-5, rtol=1e-5)
    assert spec.layer_types == tuple(getattr(hf.config, "layer_types", None) or spec.layer_types)


def test_specs_describe_each_family(family_dirs):
    specs = {name: load_model_spec(d) for name, d in family_dirs.items()}
    assert specs["qwen3"].layer_types == (FULL, SLIDING, SLIDING) and specs["qwen3"].qk_norm
    assert specs["qwen2"].layer_windows == (None, None, 16) and specs["qwen2"].qkv_bias
    assert specs["mistral"].layer_windows == (16, 16)
    moe = specs["qwen3_moe"].moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize, moe.layers) == (
        8,
        2,
        32,
        False,
        (0, 2),
    )
    assert specs["mixtral"].moe.renormalize and specs["mixtral"].moe.layers == (0, 1)
    gemma2, gemma3 = specs["gemma2"], specs["gemma3"]
    assert (gemma2.norm, gemma2.mlp_act, gemma2.sandwich_norms) == ("gemma", "gelu_tanh", True)
    assert (gemma2.attn_soft_cap, gemma2.final_soft_cap, gemma2.attn_scale) == (3.0, 4.0, 24**-0.5)
    assert gemma2.embed_scale == math.sqrt(64) and gemma2.layer_windows == (16, None, 16)
    assert gemma3.qk_norm and gemma3.layer_types == (SLIDING, SLIDING, FULL)
    assert (gemma3.rope.rope_type, gemma3.rope.factor, gemma3.rope.theta) == ("linear", 2.0, 1e5)
    assert gemma3.layer_rope(0) == gemma3.local_rope and gemma3.local_rope.theta == 1e4
    phi3 = specs["phi3"].rope
    assert (phi3.rope_type, phi3.partial_rotary_factor, phi3.original_max_position_embeddings) == (
        "longrope",
        0.75,
        LONGROPE_ORIGINAL,
    )
    assert phi3.attention_factor == pytest.approx(math.sqrt(1 + math.log(256 / 64) / math.log(64)))


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    },
    "yarn": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    },
    "yarn_mscale": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
    },
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "longrope": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.2 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)],
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_tables_match_hugging_face(name, tmp_path):
    """Our cos/sin tables against transformers' rotary module of a Llama with each rope type (for
    LongRoPE: positions below the original length from a short forward, the rest from a long one)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=dict(ROPES[name])
    )
    config.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {**json.loads((tmp_path / "config.json").read_text()), "architectures": ["LlamaForCausalLM"]}
        )
    )
    spec = load_model_spec(tmp_path)
    cos, sin = rope_tables(spec.rope, spec.head_dim, 256)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    for positions in (torch.arange(64), torch.arange(64, 256)):  # each within one regime
        ref_cos, ref_sin = rotary(x, positions[None])
        torch.testing.assert_close(cos[positions], ref_cos[0, :, :8], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sin[positions], ref_sin[0, :, :8], atol=1e-6, rtol=1e-5)


def test_phi3_decode_past_the_longrope_length_matches_cached_hugging_face(family_dirs):
    """Past original_max_position_embeddings each new position takes the long factors, keys already
    cached keep theirs: transformers' forward with a KV cache, token by token, does the same.
    (Its `generate` instead recomputes the sequence with the long factors there: executor.rotary.)"""
    model_dir = family_dirs["phi3"]
    model, hf = _load(model_dir), _hf(model_dir)
    spec = model.spec
    prompt = _random_prompt(LONGROPE_ORIGINAL - 6, seed=1)
    kv = KVCache(
        KVCacheLayout(spec.num_layers, 16, spec.num_kv_heads, spec.head_dim, torch.float32), 8, 0, CPU
    )
    blocks, ours, theirs = [3, 0, 6, 1, 7, 2], [], []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    inputs = build_step_inputs([prompt], [0], [blocks], [True], 16, CPU)
    logits = model(inputs.input_ids, inputs.meta, kv.layer_caches(), torch.tensor([len(prompt) - 1]))
    for position in range(len(prompt), LONGROPE_ORIGINAL + 12):
        token = int(out.logits[0, -1].argmax())
        torch.testing.assert_close(logits[-1], out.logits[0, -1], atol=2e-5, rtol=1e-5)
        with torch.no_grad():
            out = hf(
                torch.tensor([[token]]),
                past_key_values=out.past_key_values,
                position_ids=torch.tensor([[position]]),
            )
        inputs = build_step_inputs([[token]], [position], [blocks], [True], 16, CPU)
        logits = model(inputs.input_ids, inputs.meta, kv.layer_caches(), None)
        ours.append(int(logits[-1].argmax()))
        theirs.append(int(out.logits[0, -1].argmax()))
    assert ours == theirs


def test_gemma3_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Gemma3ForConditionalGeneration's language_model.* weights run as Gemma3ForCausalLM's; the
    vision tower and projector are skipped. Logits of a text prompt equal transformers'."""
    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8, layer_types=[SLIDING, FULL],
        query_pre_attn_scalar=8, initializer_range=0.1,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=290,
        eoi_token_index=291, image_token_index=292,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    hf.save_pretrained(tmp_path)
    model = _load(tmp_path)
    assert model.spec.architecture == "Gemma3ForConditionalGeneration" and model.spec.layer_windows == (
        8,
        None,
    )
    assert model.spec.eos_token_ids == (1,)
    prompt = _random_prompt(30, seed=3)
    prompt = [t % 280 for t in prompt]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prompt_logits(model, prompt), expected, atol=2e-5, rtol=1e-5)


def test_expert_and_fused_checkpoint_shards_reassemble(family_dirs):
    """-tp 2: each expert's gate/up rows and down columns split like a dense MLP's (the router and
    Qwen3-MoE's dense layer as usual); Phi-3's fused qkv_proj / gate_up_proj are split into their
    parts before sharding, so each rank holds its heads' q, k, v and its gate and up rows."""
    for name in ("qwen3_moe", "mixtral"):
        full = _load(family_dirs[name])
        shards = [_load(family_dirs[name], shard=TPShard(r, 2)) for r in range(2)]
        moe = full.spec.moe
        half = moe.intermediate_size // 2
        for layer in moe.layers:
            experts = full.layers[layer].mlp.experts
            parts = [s.layers[layer].mlp.experts for s in shards]
            gate, up = experts.w13.weight.split(moe.intermediate_size, dim=1)
            local = [p.w13.weight.split(half, dim=1) for p in parts]
            assert torch.equal(torch.cat([g for g, _ in local], dim=1), gate)
            assert torch.equal(torch.cat([u for _, u in local], dim=1), up)
            assert torch.equal(torch.cat([p.w2.weight for p in parts], dim=2), experts.w2.weight)
            router = full.layers[layer].mlp.gate.weight
            assert all(torch.equal(s.layers[layer].mlp.gate.weight, router) for s in shards)
    full = _load(family_dirs["phi3"])
    shards = [_load(family_dirs["phi3"], shard=TPShard(r, 2)) for r in range(2)]
    spec, inter = full.spec, full.spec.intermediate_size
    q, k, v = full.layers[0].self_attn.qkv_proj.weight.split([spec.q_size, spec.kv_size, spec.kv_size])
    sizes = [spec.q_size // 2, spec.kv_size // 2, spec.kv_size // 2]
    local = [s.layers[0].self_attn.qkv_proj.weight.split(sizes) for s in shards]
    for j, whole in enumerate((q, k, v)):
        assert torch.equal(torch.cat([p[j] for p in local]), whole)
    gate, up = full.layers[0].mlp.gate_up_proj.weight.split(inter)
    local = [s.layers[0].mlp.gate_up_proj.weight.split(inter // 2) for s in shards]
    assert torch.equal(torch.cat([g for g, _ in local]), gate)
    assert torch.equal(torch.cat([u for _, u in local]), up)


def test_fp8_experts_are_quantized_per_row_and_the_router_is_not(family_dirs, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_FP8_REFERENCE", "1")
    full, quantized = _load(family_dirs["qwen3_moe"]), _load(family_dirs["qwen3_moe"], "fp8")
    mlp, ref = quantized.layers[0].mlp, full.layers[0].mlp
    assert mlp.gate.weight.dtype == torch.float32 and torch.equal(mlp.gate.weight, ref.gate.weight)
    for name in ("w13", "w2"):
        w, original = getattr(mlp.experts, name), getattr(ref.experts, name).weight
        assert w.weight.dtype == torch.float8_e4m3fn and w.weight_scale.shape == original.shape[:2]
        dequantized = w.weight.float() * w.weight_scale[..., None]
        torch.testing.assert_close(dequantized, original, rtol=1 / 16, atol=1e-5)
    # The same tokens take the same experts (full-precision router); FP8 weights move the result
    # by about e4m3's rounding. The whole model's logits move further (every projection is FP8).
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mlp.route(x)[1], ref.route(x)[1])
    assert ((mlp(x) - ref(x)).norm() / ref(x).norm()).item() < 0.05
    prompt = _random_prompt(40, seed=4)
    base, fp8 = _prompt_logits(full, prompt), _prompt_logits(quantized, prompt)
    assert ((fp8 - base).norm() / base.norm()).item() < 0.25


def _edited_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


_DROP = object()


_SHORT_LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]}
_PROPORTIONAL = {"rope_type": "proportional", "rope_theta": 1e4}
_PARTIAL = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
REFUSALS = [
    ("mistral", {"architectures": ["FalconForCausalLM"]}, "Falcon.*supported: Llama.*Gemma3ForCausalLM"),
    ("mistral", {"rope_parameters": _PROPORTIONAL}, "Mistral.*type='proportional' is not.*yarn, longrope"),
    ("mistral", {"hidden_act": "gelu"}, "MistralForCausalLM: hidden_act='gelu' is not supported"),
    ("qwen3", {"rope_parameters": _PARTIAL}, "Qwen3ForCausalLM: partial_rotary_factor=0.5"),
    ("gemma2", {"query_pre_attn_scalar": None}, "query_pre_attn_scalar"),
    ("gemma2", {"sliding_window": None}, "Gemma2ForCausalLM: config field 'sliding_window' is unset"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "Gemma3ForCausalLM: attn_logit_softcapping=50.0"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported.*gelu_pytorch_tanh"),
    ("qwen3_moe", {"num_experts_per_tok": None}, "num_experts_per_tok"),
    ("phi3", {"rope_parameters": _SHORT_LONGROPE}, "short_factor field must have length 8"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "changes", "message"), REFUSALS)
def test_unsupported_configs_fail_at_start_naming_the_field(family, changes, message, family_dirs, tmp_path):
    edited = _edited_config(family_dirs[family], tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model_spec(edited)


def test_unknown_checkpoint_tensors_fail_loudly(family_dirs, tmp_path):
    """A tensor with no canonical place (here transformers' fused 3-D experts layout) names itself."""
    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(family_dirs["qwen3_moe"], tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(8, 64, 64)
    save_file(tensors, model_dir / "model.safetensors")
    spec = load_model_spec(model_dir)
    with pytest.raises(UnsupportedModelError, match="model.layers.0.mlp.experts.gate_up_proj"):
        load_weights(CausalLM(spec, MAX_LEN, CPU, torch.float32), spec, model_dir)


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3"])
def test_make_model_shapes_of_the_new_families_load_here_and_in_transformers(family, tmp_path):
    """`pagedserve make-model`'s MoE and sliding-window benchmark shapes, scaled down: the files
    load through our loader and transformers alike, with equal logits."""
    import dataclasses

    from pagedserve.model_shapes import SHAPES, write_shape_model

    big = SHAPES["qwen3-30b-a3b" if family == "qwen3_moe" else "gemma3-12b"]
    small = dataclasses.replace(
        big, hidden_size=64, intermediate_size=96, num_hidden_layers=6 if family == "gemma3" else 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1024,
        max_position_embeddings=256, num_experts=min(big.num_experts, 4), moe_intermediate_size=32,
        num_experts_per_tok=min(big.num_experts_per_tok, 2), sliding_window=8,
    )  # fmt: skip
    directory = write_shape_model(tmp_path / "m", small, progress=False)
    spec = load_model_spec(directory)
    if family == "gemma3":
        assert spec.layer_types == (SLIDING,) * 5 + (FULL,) and spec.rope.factor == 8.0
    else:
        assert spec.moe.num_experts == 4 and spec.moe.renormalize
    model = CausalLM(spec, MAX_LEN, CPU, torch.float32, hybrid_kv_cache=False)  # one table: _prompt_logits
    load_weights(model, spec, directory)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = _random_prompt(20, seed=5)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prompt_logits(model, prompt), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_weights_fill_every_parameter_of_a_weightless_directory(quantization, tmp_path, monkeypatch):
    """`make-model --no-weights` + `--load-format dummy` (benchmark shapes too big for the disk): the
    directory holds no weights, every parameter gets a random value (norms 1, FP8 experts quantized
    per row), the forward runs, and the Hugging Face baseline builds the same shape from the config."""
    import dataclasses

    from pagedserve.bench.baselines import _load_hf_model
    from pagedserve.executor.loader import init_dummy_weights
    from pagedserve.model_shapes import SHAPES, write_shape_model

    monkeypatch.setenv("PAGEDSERVE_FP8_REFERENCE", "1")
    small = dataclasses.replace(
        SHAPES["qwen3-30b-a3b"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1024,
        max_position_embeddings=256, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
    )  # fmt: skip
    directory = write_shape_model(tmp_path / "m", small, progress=False, weights=False)
    assert not list(directory.glob("*.safetensors"))
    spec = load_model_spec(directory)
    model = CausalLM(spec, MAX_LEN, CPU, torch.float32, quantization, hybrid_kv_cache=False)
    with torch.no_grad():
        for param in model.parameters():
            if param.element_size() > 1:  # not FP8 (no NaN there)
                param.fill_(float("nan"))
    init_dummy_weights(model, spec)
    for name, param in model.named_parameters():
        assert torch.isfinite(param.float()).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
    assert model.layers[0].mlp.experts.w13.weight.float().std() > 0
    logits = _prompt_logits(model, _random_prompt(20, seed=6))
    assert torch.isfinite(logits).all() and logits.std() > 0
    hf, _ = _load_hf_model(str(directory), "cpu")
    assert sum(p.numel() for p in hf.parameters()) == sum(
        p.numel() for n, p in model.named_parameters() if not n.endswith("weight_scale")
    )
