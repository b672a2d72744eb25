"""Loads a Hugging Face checkpoint of a supported family into our own modules.

The config is read with `transformers.AutoConfig` (it normalises the many config.json variants)
and turned into a `ModelSpec` by the architecture's family (`executor.models`); the weights are
read with safetensors; no transformers modeling code runs. Each checkpoint tensor takes its
canonical name first (the family's renames; Phi-3's fused qkv_proj / gate_up_proj split into their
parts), then goes into its slice of our parameters: q/k/v and gate/up are fused into single
matrices, each expert's gate/up/down stacked into the experts' w13 / w2 (`executor.moe`), by
copying each tensor into its place, so weights stream from disk to the device one tensor at a time.

Strict: an architecture, config field or checkpoint tensor we do not know fails loudly at start
(`UnsupportedModelError`), naming it and what is supported, and so does a parameter left unloaded.
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

from pagedserve.executor.models import FAMILIES, SUPPORTED_ARCHITECTURES, Family
from pagedserve.executor.models.common import base_fields
from pagedserve.executor.rotary import ROPE_TYPES
from pagedserve.executor.spec import ModelSpec, MoESpec, RopeConfig, UnsupportedModelError

if TYPE_CHECKING:
    from pagedserve.executor.parallel import TPShard

log = structlog.get_logger(__name__)

SUPPORTED_ROPE_TYPES = (*ROPE_TYPES, "dynamic")

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "ModelSpec",
    "MoESpec",
    "RopeConfig",
    "UnsupportedModelError",
    "family_of",
    "init_dummy_weights",
    "iter_checkpoint",
    "load_model_spec",
    "load_weights",
]


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _eos_token_ids(model_dir: Path, *configs: Any) -> tuple[int, ...]:
    """EOS ids of config.json (and its text config) and generation_config.json together (Llama-3
    lists several)."""
    ids = [i for hf in configs for i in _as_ids(getattr(hf, "eos_token_id", None))]
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        ids += _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def family_of(spec: ModelSpec) -> Family:
    return FAMILIES[spec.architecture]


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """Reads config.json (via AutoConfig) and checks the model is one we can run."""
    import transformers

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json; --model must be a checkpoint directory")
    try:
        hf = transformers.AutoConfig.from_pretrained(model_dir)
    except OSError:
        raise
    except Exception as exc:  # its validation (huggingface_hub's strict dataclasses: an unset field...)
        raise UnsupportedModelError(f"transformers refuses {model_dir / 'config.json'}: {exc}") from exc
    architectures = list(getattr(hf, "architectures", None) or [])
    arch = next((a for a in architectures if a in FAMILIES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {architectures or hf.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    family = FAMILIES[arch]
    text = family.text_config(hf)
    fields = base_fields(text, arch)
    fields.update(family.describe(text, arch))
    return ModelSpec(
        name=model_dir.name,
        architecture=arch,
        eos_token_ids=_eos_token_ids(model_dir, hf, text)
        if text is not hf
        else _eos_token_ids(model_dir, hf),
        **fields,
    )


def iter_checkpoint(
    model_dir: str | Path, ignored_prefixes: tuple[str, ...] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, CPU tensor) for every tensor of a single-file or sharded safetensors checkpoint
    (those whose names start with one of `ignored_prefixes` are not even read)."""
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
                if not name.startswith(ignored_prefixes):
                    yield name, f.get_tensor(name)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
# (module, tensor) names of per-layer KV cache scales: vLLM's, and compressed-tensors' output scales.
_KV_SCALES = {
    ("self_attn", "k_scale"): "k_scale",
    ("self_attn", "v_scale"): "v_scale",
    ("self_attn.k_proj", "output_scale"): "k_scale",
    ("self_attn.v_proj", "output_scale"): "v_scale",
}
# Modules whose tensors keep their names (under layers.N.).
_DIRECT = (
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.down_proj",
    "mlp.gate",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
# Checkpoints that store them fused (Phi-3): fused module -> its parts, split by rows.
_FUSED_IN_CHECKPOINT = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_ROW_SPLIT_KINDS = ("weight", "bias", "weight_scale")


@dataclass(frozen=True)
class _Destination:
    """Where a checkpoint tensor goes: rows [offset, offset + rows) of our parameter `target`
    (rows -1: all of it), of expert `expert`'s slice when the parameter stacks experts."""

    target: str
    offset: int = 0
    rows: int = -1
    expert: int | None = None


def _canonical(
    family: Family, spec: ModelSpec, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """The (canonical name, tensor) pairs checkpoint tensor `name` stands for (see executor.models)."""
    for pattern, replacement in family.renames:
        name = re.sub(pattern, replacement, name)
    if not family.fused_checkpoint:
        return [(name, tensor)]
    match = _LAYER.match(name)
    module, _, kind = (match.group(2) if match else "").rpartition(".")
    if module not in _FUSED_IN_CHECKPOINT:
        return [(name, tensor)]
    prefix = name[: len(name) - len(match.group(2))]
    parts = _FUSED_IN_CHECKPOINT[module]
    if kind not in _ROW_SPLIT_KINDS or tensor.numel() == 1:  # per-tensor values go to every part
        return [(f"{prefix}{part}.{kind}", tensor) for part in parts]
    if module == "self_attn.qkv_proj":
        sizes = [spec.q_size, spec.kv_size, spec.kv_size]
    else:
        sizes = [spec.intermediate_size] * 2
    if tensor.shape[0] != sum(sizes):
        raise UnsupportedModelError(f"{name}: {tensor.shape[0]} rows, expected {sum(sizes)} ({sizes})")
    return [(f"{prefix}{part}.{kind}", t) for part, t in zip(parts, tensor.split(sizes), strict=True)]


def _destination(spec: ModelSpec, name: str) -> _Destination | None:
    """Where canonical checkpoint tensor `name` goes; None means the tensor is not used (rotary
    caches some checkpoints carry, a tied lm_head, FP8 checkpoints' static input scales)."""
    if name == "model.embed_tokens.weight":
        return _Destination("embed_tokens.weight")
    if name == "model.norm.weight":
        return _Destination("norm.weight")
    if name == "lm_head.weight":
        return None if spec.tie_word_embeddings else _Destination("lm_head")
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
        return _Destination(f"{prefix}self_attn.{_KV_SCALES[module, kind]}")
    if module in fused:
        target, offset, rows = fused[module]
        return _Destination(f"{prefix}{target}.{kind}", offset, rows)
    expert = _EXPERT.match(module)
    if expert is not None and spec.moe is not None:
        index, proj = int(expert.group(1)), expert.group(2)
        moe_inter = spec.moe.intermediate_size
        if proj == "down_proj":
            return _Destination(f"{prefix}mlp.experts.w2.{kind}", expert=index)
        offset = 0 if proj == "gate_proj" else moe_inter
        return _Destination(f"{prefix}mlp.experts.w13.{kind}", offset, moe_inter, index)
    if module in _DIRECT:
        return _Destination(f"{prefix}{rest}")
    raise UnsupportedModelError(f"unexpected checkpoint tensor {name!r}")


def _expert(param: torch.Tensor, expert: int | None) -> torch.Tensor:
    """Expert `expert`'s slice of a stacked parameter (a view), or the parameter itself."""
    return param if expert is None else param[expert]


def load_weights(
    model: torch.nn.Module, spec: ModelSpec, model_dir: str | Path, shard: TPShard | None = None
) -> None:
    """Copies the checkpoint into `model`'s (already allocated) parameters, checking completeness.

    With `--quantization fp8` (the model's linear layers are `Fp8Linear`, the experts FP8 too)
    full-precision weights are quantized per output row as they are copied and FP8 checkpoints are
    copied as they are (see `executor.quantization`). KV cache scales in the checkpoint fill the
    layers' k_scale / v_scale buffers when those exist (`--kv-cache-dtype fp8`) and are skipped
    otherwise; the model's `kv_scales_loaded` says whether every layer got both.

    With `shard` (tensor parallelism) `spec` is the whole model's and `model` holds rank
    `shard.rank`'s part: each (canonical) checkpoint tensor is narrowed to that part first
    (`executor.parallel`), then placed as usual in the rank's smaller fused parameters.

    Raises:
        UnsupportedModelError: on unknown tensors, shape mismatches, or parameters left unloaded.
    """
    from pagedserve.executor import quantization

    family = family_of(spec)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    filled: dict[str, int] = dict.fromkeys(params, 0)
    kv_scales_seen: set[str] = set()
    dest_spec = spec if shard is None else shard.local_spec(spec)
    with torch.no_grad():
        for checkpoint_name, whole in iter_checkpoint(model_dir, family.ignored_prefixes):
            for name, tensor in _canonical(family, spec, checkpoint_name, whole):
                if shard is not None:
                    tensor = shard.narrow(spec, name, tensor)
                dest = _destination(dest_spec, name)
                if dest is None:
                    continue
                try:
                    _copy(params, buffers, filled, kv_scales_seen, dest, tensor, quantization)
                except UnsupportedModelError as exc:
                    raise UnsupportedModelError(f"{checkpoint_name}: {exc}") from None
    model.kv_scales_loaded = bool(kv_scales_seen) and len(kv_scales_seen) == sum(
        n.endswith(("k_scale", "v_scale")) for n in buffers
    )
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise UnsupportedModelError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:8])}")


def _copy(
    params, buffers, filled, kv_scales_seen, dest: _Destination, tensor: torch.Tensor, quantization
) -> None:
    """Copies one (narrowed, canonical) checkpoint tensor to `dest`, counting what it filled."""
    target, offset, rows = dest.target, dest.offset, dest.rows
    if target.endswith(("k_scale", "v_scale")):
        if target in buffers:
            buffers[target].copy_(tensor.reshape(-1)[:1].float())
            kv_scales_seen.add(target)
        return
    if target not in params:
        if tensor.dtype == torch.float8_e4m3fn or target.endswith(".weight_scale"):
            raise UnsupportedModelError(f"the tensor is FP8 ({tensor.dtype}); run with --quantization fp8")
        raise UnsupportedModelError(f"the tensor has no place in the model ({target})")
    param = _expert(params[target], dest.expert)
    if quantization.is_fp8_weight(param):
        scale_name = target.removesuffix(".weight") + ".weight_scale"
        quantization.load_weight_slice(param, _expert(params[scale_name], dest.expert), offset, rows, tensor)
        num_rows = param.shape[0] if rows == -1 else rows
        filled[target] += num_rows * param.shape[1]
        if tensor.dtype != torch.float8_e4m3fn:
            filled[scale_name] += num_rows
        return
    if target.endswith(".weight_scale"):
        quantization.load_scale_slice(param, offset, rows, tensor)
        filled[target] += param.shape[0] if rows == -1 else rows
        return
    view = param if rows == -1 else param.narrow(0, offset, rows)
    if view.shape != tensor.shape:
        raise UnsupportedModelError(f"checkpoint shape {tuple(tensor.shape)} != expected {tuple(view.shape)}")
    view.copy_(tensor)
    filled[target] += view.numel()


def init_dummy_weights(model: torch.nn.Module, spec: ModelSpec, seed: int = 0, std: float = 0.02) -> None:
    """Fills `model`'s parameters with random weights instead of reading a checkpoint (vLLM's
    `--load-format dummy`), for benchmarks of shapes whose checkpoint would not fit the disk (a
    Qwen3-30B-A3B shape is 61 GB): normal(0, std) matrices drawn on the model's device, norms 1
    (Gemma's (1 + weight) norms 0), biases 0. FP8 parameters are quantized from bf16 draws as a
    checkpoint's would be, one expert at a time so that the bf16 copy stays small."""
    from pagedserve.executor import quantization

    params = dict(model.named_parameters())
    generator: torch.Generator | None = None
    with torch.no_grad():
        for name, param in params.items():
            if name.endswith(".weight_scale"):
                continue  # filled with its weight
            if name.endswith("norm.weight"):
                param.fill_(0.0 if spec.norm == "gemma" else 1.0)
                continue
            if name.endswith(".bias"):
                param.zero_()
                continue
            if generator is None or generator.device != param.device:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            if not quantization.is_fp8_weight(param):
                param.normal_(0.0, std, generator=generator)
                continue
            scale = params[name.removesuffix(".weight") + ".weight_scale"]
            slices = [(param, scale)] if param.dim() == 2 else list(zip(param, scale, strict=True))
            for weight, weight_scale in slices:
                draw = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device)
                draw.normal_(0.0, std, generator=generator)
                quantization.load_weight_slice(weight, weight_scale, 0, -1, draw)
