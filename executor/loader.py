"""Loads a Hugging Face Llama-family checkpoint into our own modules.

The config is read with `transformers.AutoConfig` (it normalises the many config.json variants),
the weights with safetensors; no transformers modeling code runs. q/k/v and gate/up are fused into
single matrices here, by copying each checkpoint tensor into its slice of the fused parameter, so
weights stream from disk to the device one tensor at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from pagedserve.executor.parallel import TPShard

log = structlog.get_logger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is not one this executor can run (architecture, activation, rope type...)."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is "default", "linear" or "llama3"."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family model, independent of transformers."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_config(hf_config: Any) -> RopeConfig:
    # transformers >= 5 exposes `rope_parameters` (theta inside); older releases and raw real-world
    # config.json files have `rope_theta` plus an optional `rope_scaling` (with "type" or "rope_type").
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    rope = RopeConfig(theta=float(params["rope_theta"]), rope_type=rope_type)
    if rope_type == "linear":
        rope = RopeConfig(theta=rope.theta, rope_type=rope_type, factor=float(params["factor"]))
    elif rope_type == "llama3":
        rope = RopeConfig(
            theta=rope.theta,
            rope_type=rope_type,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    return rope


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _eos_token_ids(model_dir: Path, hf_config: Any) -> tuple[int, ...]:
    """EOS ids of config.json and generation_config.json together (Llama-3 lists several)."""
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        ids += _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """Reads config.json (via AutoConfig) and checks the model is one we can run."""
    import transformers

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json; --model must be a checkpoint directory")
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    architectures = list(getattr(hf, "architectures", None) or [])
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {architectures or hf.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    model_type = SUPPORTED_ARCHITECTURES[arch]
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    if getattr(hf, "pretraining_tp", 1) not in (None, 1):
        log.warning("ignoring pretraining_tp", pretraining_tp=hf.pretraining_tp)

    num_heads = hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads {num_heads} not a multiple of kv heads {num_kv_heads}"
        )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads

    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
        sliding_window = hf.sliding_window if getattr(hf, "use_sliding_window", False) else None
    else:
        attention_bias = bool(getattr(hf, "attention_bias", False))
        qkv_bias = o_bias = attention_bias
        sliding_window = getattr(hf, "sliding_window", None) if model_type == "mistral" else None

    return ModelSpec(
        name=model_dir.name,
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope=_rope_config(hf),
        max_position_embeddings=int(hf.max_position_embeddings),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        sliding_window=int(sliding_window) if sliding_window else None,
        eos_token_ids=_eos_token_ids(model_dir, hf),
    )


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, CPU tensor) for every tensor of a single-file or sharded safetensors checkpoint."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (pickled .bin is not supported)")
    for file in files:
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# (module, tensor) names of per-layer KV cache scales: vLLM's, and compressed-tensors' output scales.
_KV_SCALES = {
    ("self_attn", "k_scale"): "k_scale",
    ("self_attn", "v_scale"): "v_scale",
    ("self_attn.k_proj", "output_scale"): "k_scale",
    ("self_attn.v_proj", "output_scale"): "v_scale",
}


def _destination(spec: ModelSpec, name: str) -> tuple[str, int, int] | None:
    """Where checkpoint tensor `name` goes: (our parameter name, row offset, row count).

    Row offset/count locate the slice of a fused parameter (qkv_proj, gate_up_proj); None means the
    tensor is not used (rotary caches some checkpoints carry, a tied lm_head).
    """
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", 0, spec.vocab_size
    if name == "model.norm.weight":
        return "norm.weight", 0, spec.hidden_size
    if name == "lm_head.weight":
        return None if spec.tie_word_embeddings else ("lm_head", 0, spec.vocab_size)
    match = _LAYER.match(name)
    if match is None:
        raise UnsupportedModelError(f"unexpected checkpoint tensor {name!r}")
    layer, rest = match.groups()
    prefix = f"layers.{layer}."
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
    }
    module, _, kind = rest.rpartition(".")
    if module == "self_attn.rotary_emb" or kind == "input_scale":
        # input_scale: a static activation scale of FP8 checkpoints; we quantize per token instead.
        return None
    if (module, kind) in _KV_SCALES:  # FP8 checkpoints' KV cache scales (buffers, not parameters)
        return f"{prefix}self_attn.{_KV_SCALES[module, kind]}", 0, -1
    if module in fused:
        target, offset, rows = fused[module]
        return f"{prefix}{target}.{kind}", offset, rows
    if module in ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
        return f"{prefix}{rest}", 0, -1
    raise UnsupportedModelError(f"unexpected checkpoint tensor {name!r}")


def load_weights(
    model: torch.nn.Module, spec: ModelSpec, model_dir: str | Path, shard: TPShard | None = None
) -> None:
    """Copies the checkpoint into `model`'s (already allocated) parameters, checking completeness.

    With `--quantization fp8` (the model's linear layers are `Fp8Linear`) full-precision weights
    are quantized as they are copied and FP8 checkpoints are copied as they are (see
    `executor.quantization`). KV cache scales in the checkpoint fill the layers' k_scale / v_scale
    buffers when those exist (`--kv-cache-dtype fp8`) and are skipped otherwise; the model's
    `kv_scales_loaded` says whether every layer got both.

    With `shard` (tensor parallelism) `spec` is the whole model's and `model` holds rank
    `shard.rank`'s part: each checkpoint tensor is narrowed to that part first
    (`executor.parallel`), then placed as usual in the rank's smaller fused parameters.

    Raises:
        UnsupportedModelError: on unknown tensors, shape mismatches, or parameters left unloaded.
    """
    from pagedserve.executor import quantization

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    filled: dict[str, int] = dict.fromkeys(params, 0)
    kv_scales_seen: set[str] = set()
    dest_spec = spec if shard is None else shard.local_spec(spec)
    with torch.no_grad():
        for name, tensor in iter_checkpoint(model_dir):
            if shard is not None:
                tensor = shard.narrow(spec, name, tensor)
            dest = _destination(dest_spec, name)
            if dest is None:
                continue
            target, offset, rows = dest
            if target.endswith(("k_scale", "v_scale")):
                if target in buffers:
                    buffers[target].copy_(tensor.reshape(-1)[:1].float())
                    kv_scales_seen.add(target)
                continue
            if target not in params:
                if tensor.dtype == torch.float8_e4m3fn or target.endswith(".weight_scale"):
                    raise UnsupportedModelError(
                        f"checkpoint tensor {name!r} is FP8 ({tensor.dtype}); run with --quantization fp8"
                    )
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} has no place in the model ({target})"
                )
            param = params[target]
            if quantization.is_fp8_weight(param):
                scale_name = target.removesuffix(".weight") + ".weight_scale"
                try:
                    quantization.load_weight_slice(param, params[scale_name], offset, rows, tensor)
                except UnsupportedModelError as exc:
                    raise UnsupportedModelError(f"{name}: {exc}") from None
                filled[target] += param.numel() if rows == -1 else rows * param.shape[1]
                if tensor.dtype != torch.float8_e4m3fn:
                    filled[scale_name] += param.shape[0] if rows == -1 else rows
                continue
            if target.endswith(".weight_scale"):
                quantization.load_scale_slice(param, offset, rows, tensor)
                filled[target] += param.numel() if rows == -1 else rows
                continue
            view = param if rows == -1 else param.narrow(0, offset, rows)
            if view.shape != tensor.shape:
                raise UnsupportedModelError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(view.shape)}"
                )
            view.copy_(tensor)
            filled[target] += view.numel()
    model.kv_scales_loaded = bool(kv_scales_seen) and len(kv_scales_seen) == sum(
        n.endswith(("k_scale", "v_scale")) for n in buffers
    )
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise UnsupportedModelError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:8])}")
