"""Builds small model directories locally: the embedded default model and test models of every family.

Nothing can be downloaded, so the weights are random (seeded) and the tokenizer is a byte-level BPE
trained on a built-in corpus. The directory has the layout of a Hugging Face checkpoint
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json), so it is loaded through
the same code path as a real model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS = """\
PagedAttention stores the key and value cache of each sequence in fixed-size blocks.
A block table maps the logical blocks of a sequence to physical blocks in GPU memory.
Requests that share a prompt prefix share physical blocks, and memory is allocated on demand.
When memory runs out, a sequence is pre-empted: swapped to the CPU or recomputed later.
The scheduler decides which requests run; the executor runs the model and samples tokens.
Continuous batching lets requests join and leave the running batch at every step.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 42.
Unicode: café, naïve, Straße, żółw, 東京, 日本語, 한국어, emoji 🙂🚀.
def main():\n    print("hello, world")\n    return 0
"""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a generated model; the defaults make a ~1M-parameter GQA Llama."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # "llama", "mistral", "qwen2", or any other transformers model_type of a causal LM
    # ("qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text", "phi3", ...).
    model_type: str = "llama"
    initializer_range: float = 0.1  # larger than HF's 0.02 so greedy argmax has clear winners
    seed: int = 0
    # Further config fields (sliding_window, layer_types, num_experts, ...), passed as they are.
    config: dict[str, Any] | None = None
    # Norm weights and biases start at transformers' constants (ones, zeros); perturbing them
    # makes a test see each one (a swapped q_norm and k_norm, a missing 1 + weight).
    perturb_vectors: bool = False


def train_tokenizer(vocab_size: int, texts: Iterable[str] | None = None):
    """A byte-level BPE tokenizer (any UTF-8 text round-trips) with <s>, </s> and <unk>, learnt on
    `texts` (default: the small built-in corpus, which yields at most ~600 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4 if texts is None else texts, trainer=trainer)
    return tokenizer


def write_tiny_model(directory: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Writes config.json, model.safetensors and tokenizer files for `spec` into `directory`."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.save_pretrained(directory)

    kwargs = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
    )
    if spec.head_dim is not None:
        kwargs["head_dim"] = spec.head_dim
    if spec.rope_scaling is not None:
        kwargs["rope_scaling"] = spec.rope_scaling
    if spec.model_type == "llama":
        kwargs["attention_bias"] = spec.attention_bias
    kwargs.update(spec.config or {})
    config = transformers.AutoConfig.for_model(spec.model_type, **kwargs)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if spec.perturb_vectors:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
