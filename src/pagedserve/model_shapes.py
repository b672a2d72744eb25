"""`pagedserve make-model`: writes benchmark model directories with random weights.

Nothing can be downloaded, so the GPU benchmark model ("llama-8b-shape" of the README's Workloads) has
Llama-3.1-8B's architecture and random bf16 weights; "qwen3-30b-a3b" (128 experts, top 8) and
"gemma3-12b" (5 local layers of window 1024 per global one) are issue 28's MoE and sliding-window
benchmark shapes, in their checkpoint layouts. The 16 GB checkpoint is streamed to one
model.safetensors tensor by tensor: the header is computed from the shapes up front, then each
tensor is generated, written and dropped, so memory stays at the size of the largest tensor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

INIT_STD = 0.02
DEFAULT_TOKENIZER_VOCAB_SIZE = 512
LLAMA31_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class ModelShape:
    """A Llama, Qwen3-MoE or Gemma 3 architecture (`family`); bf16 weights of this shape are
    generated, never a model instantiated."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = field(default=None, hash=False)
    # prompts are token ids, so a small trained vocabulary is enough (make-model --tokenizer-vocab-size)
    tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB_SIZE
    family: str = "llama"  # "llama", "qwen3_moe" or "gemma3"
    # qwen3_moe: routed experts on every layer
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # gemma3: sliding_window_pattern - 1 local layers (window sliding_window) per global one
    sliding_window: int = 1024
    sliding_window_pattern: int = 6
    rope_local_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.tokenizer_vocab_size > self.vocab_size:
            raise ValueError("the tokenizer vocabulary must fit in the model's vocabulary")
        if self.family not in ("llama", "qwen3_moe", "gemma3"):
            raise ValueError(f"family must be llama, qwen3_moe or gemma3, got {self.family!r}")

    def tensor_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(HF weight name, shape) in file order, in the family's checkpoint layout."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        yield "model.embed_tokens.weight", (self.vocab_size, h)
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            yield p + "input_layernorm.weight", (h,)
            yield p + "self_attn.q_proj.weight", (q, h)
            yield p + "self_attn.k_proj.weight", (kv, h)
            yield p + "self_attn.v_proj.weight", (kv, h)
            yield p + "self_attn.o_proj.weight", (h, q)
            if self.family != "llama":
                yield p + "self_attn.q_norm.weight", (d,)
                yield p + "self_attn.k_norm.weight", (d,)
            yield p + "post_attention_layernorm.weight", (h,)
            if self.family == "gemma3":
                yield p + "pre_feedforward_layernorm.weight", (h,)
                yield p + "post_feedforward_layernorm.weight", (h,)
            if self.family == "qwen3_moe":
                e = self.moe_intermediate_size
                yield p + "mlp.gate.weight", (self.num_experts, h)
                for x in range(self.num_experts):
                    yield p + f"mlp.experts.{x}.gate_proj.weight", (e, h)
                    yield p + f"mlp.experts.{x}.up_proj.weight", (e, h)
                    yield p + f"mlp.experts.{x}.down_proj.weight", (h, e)
            else:
                yield p + "mlp.gate_proj.weight", (i, h)
                yield p + "mlp.up_proj.weight", (i, h)
                yield p + "mlp.down_proj.weight", (h, i)
        yield "model.norm.weight", (h,)
        if self.family != "gemma3":  # Gemma ties the LM head to the embeddings
            yield "lm_head.weight", (self.vocab_size, h)

    def num_parameters(self) -> int:
        total = 0
        for _, shape in self.tensor_shapes():
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total

    def hf_config(self, bos_token_id: int, eos_token_id: int) -> dict:
        """config.json in Llama-3.1's layout (rope_theta + rope_scaling, as the real file has)."""
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": 1e-5,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": INIT_STD,
            "tie_word_embeddings": False,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": "bfloat16",
            "use_cache": True,
        }
        if self.family == "qwen3_moe":
            config.update(
                architectures=["Qwen3MoeForCausalLM"],
                model_type="qwen3_moe",
                rms_norm_eps=1e-6,
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        elif self.family == "gemma3":
            for key in ("hidden_act", "mlp_bias"):
                del config[key]
            config.update(
                architectures=["Gemma3ForCausalLM"],
                model_type="gemma3_text",
                hidden_activation="gelu_pytorch_tanh",
                rms_norm_eps=1e-6,
                query_pre_attn_scalar=self.head_dim,
                sliding_window=self.sliding_window,
                sliding_window_pattern=self.sliding_window_pattern,
                rope_local_base_freq=self.rope_local_theta,
                final_logit_softcapping=None,
                attn_logit_softcapping=None,
                tie_word_embeddings=True,
            )
        return config


SHAPES: dict[str, ModelShape] = {
    # the README's "llama-8b-shape" (Workloads): Llama-3.1-8B (8.03 B parameters, 16.06 GB in bf16).
    "llama-8b": ModelShape(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    # The same topology scaled down (GQA 4:1, llama3 rope, vocab > 100000) for tests and CI.
    "llama-8b-mini": ModelShape(
        hidden_size=128,
        intermediate_size=448,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    # Qwen3-30B-A3B (30.5 B parameters, 61 GB in bf16): 48 layers of 128 experts (768 wide), top 8.
    "qwen3-30b-a3b": ModelShape(
        family="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    # Gemma-3-12B's text model (11.8 B parameters, 23.5 GB in bf16): 5 local layers (window 1024)
    # per global one, the global layers' rope scaled linearly by 8.
    "gemma3-12b": ModelShape(
        family="gemma3",
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=262208,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=1024,
    ),
}


def _safetensors_header(shape: ModelShape) -> bytes:
    """The safetensors header (8-byte length + JSON, padded to 8 bytes) for bf16 tensors of `shape`."""
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in shape.tensor_shapes():
        size = 2
        for dim in dims:
            size *= dim
        entries[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def write_weights(
    path: Path, shape: ModelShape, seed: int = 0, progress: bool = True, device: str = "cpu"
) -> None:
    """Streams normal(0, 0.02) bf16 weights (norms = 1, Gemma's (1 + weight) norms = 0) to one
    safetensors file, tensor by tensor.

    `device="cuda"` draws the numbers on the GPU (seconds instead of minutes for 8B parameters);
    the values then differ from a CPU run with the same seed, as the generators differ.
    """
    import torch
    from tqdm import tqdm

    generator = torch.Generator(device=device).manual_seed(seed)
    total_bytes = 2 * shape.num_parameters()
    tmp = path.with_suffix(".tmp")
    with (
        open(tmp, "wb") as f,
        tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        bar.set_description(f"writing {path.name}")
        f.write(_safetensors_header(shape))
        for name, dims in shape.tensor_shapes():
            if name.endswith("norm.weight"):
                fill = torch.zeros if shape.family == "gemma3" else torch.ones
                tensor = fill(dims, dtype=torch.bfloat16)
            else:
                tensor = torch.empty(dims, dtype=torch.bfloat16, device=device)
                tensor = tensor.normal_(0.0, INIT_STD, generator=generator).cpu()
            f.write(tensor.view(torch.int16).numpy().tobytes())
            bar.update(tensor.numel() * 2)
            del tensor
    tmp.replace(path)


# Tokenizers larger than the built-in corpus can give are learnt on this much of this machine's
# Python sources (`bench.corpus`: the standard library first), ~30 s for 128,000 tokens on 2 cores.
LARGE_TOKENIZER_TRAIN_BYTES = 64 << 20


def write_tokenizer(directory: Path, vocab_size: int) -> tuple[int, int]:
    """Saves a byte-level BPE tokenizer AutoTokenizer can load; returns (bos, eos) ids. Up to 512
    tokens it is learnt on the small built-in corpus; a larger one (a real model's size, which the
    cost of structured outputs' masks depends on) on this machine's Python sources."""
    from transformers import PreTrainedTokenizerFast

    from pagedserve.tiny_model import train_tokenizer

    texts = None
    if vocab_size > DEFAULT_TOKENIZER_VOCAB_SIZE:
        from pagedserve.bench import corpus

        roots, _ = corpus.corpus_roots()
        files = sorted(corpus.list_files(roots), key=lambda f: f.order_key)
        texts = [text for _, text in corpus.read_texts(files, LARGE_TOKENIZER_TRAIN_BYTES)]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, texts),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.save_pretrained(directory)
    return tokenizer.bos_token_id, tokenizer.eos_token_id


def write_shape_model(
    directory: str | Path,
    shape: ModelShape,
    seed: int = 0,
    progress: bool = True,
    device: str = "cpu",
    weights: bool = True,
) -> Path:
    """Writes config.json, generation_config.json, the tokenizer files and (unless `weights` is
    False: served with --load-format dummy) model.safetensors."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bos, eos = write_tokenizer(directory, shape.tokenizer_vocab_size)
    config = shape.hf_config(bos, eos)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if weights:
        write_weights(directory / "model.safetensors", shape, seed=seed, progress=progress, device=device)
    return directory


def build_parser() -> argparse.ArgumentParser:
    """`pagedserve make-model`'s flags (the documentation's flag reference is generated from it)."""
    parser = argparse.ArgumentParser(
        prog="pagedserve make-model", description="write a benchmark model directory with random weights"
    )
    parser.add_argument(
        "--shape",
        default="llama-8b",
        choices=(*SHAPES, "tiny"),
        help="llama-8b: the llama-8b-shape (docs/performance/index.md; 16 GB, bf16); llama-8b-mini: the "
        "same topology scaled down; qwen3-30b-a3b (61 GB), gemma3-12b (23.5 GB): the MoE and "
        "sliding-window benchmark shapes; tiny: a small random-weight Llama (pagedserve.tiny_model)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--device", default="cpu", help="where to draw the random numbers (cpu or cuda)")
    parser.add_argument(
        "directory", type=Path, help="where to write config.json, the tokenizer and the weights"
    )
    parser.add_argument(
        "--no-weights", action="store_true",
        help="write the config and the tokenizer only; serve the directory with --load-format dummy "
        "(random weights drawn at start: for shapes too big for the disk)",
    )  # fmt: skip
    parser.add_argument(
        "--force", action="store_true", help="overwrite the model files of a directory that has weights"
    )
    parser.add_argument(
        "--tokenizer-vocab-size", type=int, default=None, metavar="N",
        help=f"tokens of the trained tokenizer (default {DEFAULT_TOKENIZER_VOCAB_SIZE}: prompts are token "
        "ids); above that it is learnt on this machine's Python sources, e.g. 128000 for structured "
        "outputs' mask costs at a real model's vocabulary (at most the shape's vocab_size)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    # The files are written in place: refuse to clobber a checkpoint (or mix stale shards of one
    # into the new model) unless asked; a directory without weights (an interrupted run) is fine.
    if args.directory.exists() and not args.directory.is_dir():
        parser.error(f"{args.directory} exists and is not a directory")
    weights = sorted(p.name for p in args.directory.glob("*.safetensors")) if args.directory.is_dir() else []
    if weights and not args.force:
        parser.error(f"{args.directory} already holds weights ({', '.join(weights[:3])}); pass --force")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        parser.error(f"argument --device: expected cpu, cuda or cuda:N, got {args.device!r}")
    if args.shape == "tiny" and args.tokenizer_vocab_size is not None:
        parser.error("--tokenizer-vocab-size is for the benchmark shapes (the tiny model has its own)")
    if args.shape == "tiny" and args.no_weights:
        parser.error("--no-weights is for the benchmark shapes (the tiny model is small)")
    if args.shape == "tiny":
        from pagedserve.tiny_model import TinyModelSpec, write_tiny_model

        write_tiny_model(args.directory, TinyModelSpec(seed=args.seed))
    else:
        shape = SHAPES[args.shape]
        if args.tokenizer_vocab_size is not None:
            if not 16 <= args.tokenizer_vocab_size <= shape.vocab_size:
                parser.error(
                    f"argument --tokenizer-vocab-size: expected 16 to the shape's vocab_size "
                    f"({shape.vocab_size}), got {args.tokenizer_vocab_size}"
                )
            shape = dataclasses.replace(shape, tokenizer_vocab_size=args.tokenizer_vocab_size)
        print(
            f"pagedserve make-model: {args.shape}, {shape.num_parameters() / 1e9:.2f} B parameters, "
            f"{2 * shape.num_parameters() / 1e9:.2f} GB{' (not written)' if args.no_weights else ''} "
            f"-> {args.directory}",
            file=sys.stderr,
        )
        write_shape_model(
            args.directory, shape, seed=args.seed, device=args.device, weights=not args.no_weights
        )
    print(json.dumps({"shape": args.shape, "directory": str(args.directory)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
