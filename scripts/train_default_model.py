"""Trains pagedserve's built-in model: a small Llama on the Python source found on this machine.

    python -m scripts.train_default_model --device cuda --output DIR   # the shipped weights
    python -m scripts.train_default_model --device cpu --quick --output DIR   # a smoke run
    python -m scripts.train_default_model --draft-of src/pagedserve/models/default --output DIR
        # the built-in model's draft for speculative decoding: its tokenizer, a smaller shape

Nothing is downloaded: the corpus is the running Python's standard library plus a fixed list of
installed packages (Python source and documentation). Files are listed in sorted order and split
into training and held-out sets BY FILE with a seeded hash of each file's path relative to its root,
so the split of a given file is the same on every machine and Python version (`pagedserve.bench.corpus`,
which `pagedserve bench --log-likelihood` scores the held-out files with). The model is transformers' own
`LlamaForCausalLM` (GQA, RoPE, SwiGLU, tied embeddings), so the directory written is a standard
Hugging Face checkpoint that both transformers and pagedserve's loader read.

Everything that decides the result (corpus, split, seeds, shape, optimiser, schedule, time budget)
is a constant below. The training length is a time budget, not a step count, because the aim is
the best held-out bits per byte in a few minutes of one GPU: the number of steps is fixed once from
the measured speed of the first steps (so the learning-rate schedule still ends at its floor), and
recorded in the report.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import structlog

from pagedserve.bench.corpus import (
    HELD_OUT_EVAL_BYTES,
    HELD_OUT_PER_MILLE,
    SITE_PACKAGES,
    SPLIT_SEED,
    TOKENIZER_TRAIN_BYTES,
    corpus_roots,
    gzip_bits_per_byte,
    held_out_texts,
    list_files,
    read_texts,
)

log = structlog.get_logger("train_default_model")

# --- model and training -------------------------------------------------------------------------


@dataclass(frozen=True)
class Hyper:
    """Model shape and optimisation; `QUICK` below is the CPU smoke-test variant."""

    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    seq_len: int = 2048  # also max_position_embeddings: the model never saw longer contexts
    rope_theta: float = 10000.0
    batch_size: int = 32  # sequences per step: 64K tokens
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decay to this fraction of the peak
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    train_seconds: float = 200.0  # the budget for the optimisation loop, compile included
    timing_steps: int = 30  # steps measured (after compile) to fix the total step count
    max_steps: int = 100_000
    eval_every: int = 400
    corpus_bytes: int | None = None  # cap on the training text (None: all of it)
    tokenizer_train_bytes: int = TOKENIZER_TRAIN_BYTES
    held_out_eval_bytes: int = HELD_OUT_EVAL_BYTES
    packages: tuple[str, ...] = SITE_PACKAGES
    seed: int = 0


CUDA = Hyper()
QUICK = replace(
    Hyper(),
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    seq_len=128,
    batch_size=8,
    peak_lr=3e-3,
    warmup_steps=5,
    train_seconds=15.0,
    timing_steps=3,
    max_steps=120,
    eval_every=40,
    corpus_bytes=1 << 20,
    tokenizer_train_bytes=256 << 10,
    held_out_eval_bytes=32 << 10,
    packages=(),  # the standard library alone: listing every package costs seconds
)
# The draft model of speculative decoding (`--draft-of`): the target's tokenizer, 2 layers and the
# target's KV shape (2 KV heads of 64), so that its KV fits the same block pool; ~6.6 MB in bf16.
DRAFT = replace(
    Hyper(),
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    train_seconds=120.0,
)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# A plain-text chat format: the model has seen Markdown headings in documentation, nothing else.
CHAT_TEMPLATE = (
    "{% for message in messages %}### {{ message['role'] }}\n{{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)


# --- tokenizer ----------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (every UTF-8 text round-trips) that prepends <s>, as Llama's tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tokenizer


def save_tokenizer(tokenizer, directory: Path) -> None:
    """tokenizer.json + tokenizer_config.json with the chat template inside (what transformers 4.x
    and 5.x both read; 5.x would otherwise write it to a separate chat_template.jinja)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config["model_max_length"] = None
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every transformers release knows
    config_path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=2) + "\n")


def encode_documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """<s> text </s> per document (the post-processor adds <s>)."""
    eos = tokenizer.token_to_id("</s>")
    return [enc.ids + [eos] for enc in tokenizer.encode_batch(texts)]


# --- figures --------------------------------------------------------------------------------------


def byte_counts(texts: list[str]) -> Counter:
    import numpy as np

    counts = np.zeros(256, dtype=np.int64)
    for text in texts:
        counts += np.bincount(np.frombuffer(text.encode(), dtype=np.uint8), minlength=256)
    return Counter(dict(enumerate(counts.tolist())))


def unigram_bits_per_byte(train_counts: Counter, vocab: int, tokens: list[int], n_bytes: int) -> float:
    """Cost of `tokens` under a unigram model of the training counts (add-one smoothing)."""
    total = sum(train_counts.values()) + vocab
    bits = sum(-math.log2((train_counts.get(t, 0) + 1) / total) for t in tokens)
    return bits / n_bytes


def model_nll(model, documents: list[list[int]], seq_len: int, device: str) -> tuple[float, int]:
    """Summed natural-log NLL of every token after each document's leading <s> (EOS excluded):
    each document in non-overlapping windows of `seq_len` + 1 tokens."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for doc in documents:
            ids = doc[:-1]  # <s> text; the trailing </s> is not part of the text's bytes
            for start in range(0, len(ids) - 1, seq_len):
                window = torch.tensor(ids[start : start + seq_len + 1], device=device)[None]
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
                    logits = model(window[:, :-1]).logits.float()
                nll = torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum")
                total += float(nll)
                count += window.shape[1] - 1
    model.train()
    return total, count


# --- training -------------------------------------------------------------------------------------


def build_model(hyper: Hyper, tokenizer):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=hyper.vocab_size,
        hidden_size=hyper.hidden_size,
        intermediate_size=hyper.intermediate_size,
        num_hidden_layers=hyper.num_layers,
        num_attention_heads=hyper.num_heads,
        num_key_value_heads=hyper.num_kv_heads,
        max_position_embeddings=hyper.seq_len,
        rope_theta=hyper.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id("<s>"),
        eos_token_id=tokenizer.token_to_id("</s>"),
        pad_token_id=None,
        initializer_range=0.02,
    )
    return transformers.LlamaForCausalLM(config)


def lr_at(step: int, total: int, hyper: Hyper) -> float:
    if step < hyper.warmup_steps:
        return hyper.peak_lr * (step + 1) / hyper.warmup_steps
    progress = min(1.0, (step - hyper.warmup_steps) / max(1, total - hyper.warmup_steps))
    floor = hyper.peak_lr * hyper.min_lr_ratio
    return floor + (hyper.peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    hyper = QUICK if args.quick else DRAFT if args.draft_of else CUDA
    if args.draft_of:  # the target's tokenizer, so that token ids mean the same in both models
        from tokenizers import Tokenizer

        target_tokenizer = Tokenizer.from_file(str(Path(args.draft_of) / "tokenizer.json"))
        hyper = replace(hyper, vocab_size=target_tokenizer.get_vocab_size())
    if args.train_seconds is not None:
        hyper = replace(hyper, train_seconds=args.train_seconds)
    device = args.device
    torch.manual_seed(hyper.seed)
    started = time.monotonic()

    roots, missing = corpus_roots(hyper.packages)
    files = sorted(list_files(roots), key=lambda f: f.order_key)
    train_files = [f for f in files if not f.held_out]
    train_texts = [t for _, t in read_texts(train_files, hyper.corpus_bytes)]
    held_texts = held_out_texts(hyper.held_out_eval_bytes, hyper.packages)
    train_bytes = sum(len(t.encode()) for t in train_texts)
    held_bytes = sum(len(t.encode()) for t in held_texts)
    log.info(
        "corpus",
        files=len(files),
        train_files=len(train_texts),
        train_mb=round(train_bytes / 1e6, 1),
        held_out_files=len(held_texts),
        held_out_kb=round(held_bytes / 1e3, 1),
        missing_packages=missing,
        seconds=round(time.monotonic() - started, 1),
    )

    tokenizer_texts, size = [], 0
    for text in train_texts:
        if size >= hyper.tokenizer_train_bytes:
            break
        tokenizer_texts.append(text)
        size += len(text.encode())
    tokenizer = target_tokenizer if args.draft_of else train_tokenizer(tokenizer_texts, hyper.vocab_size)
    train_docs = encode_documents(tokenizer, train_texts)
    held_docs = encode_documents(tokenizer, held_texts)
    stream = np.fromiter((t for doc in train_docs for t in doc), dtype=np.int64)
    log.info(
        "tokenized",
        train_tokens=len(stream),
        bytes_per_token=round(train_bytes / len(stream), 3),
        seconds=round(time.monotonic() - started, 1),
    )
    counts = Counter(dict(enumerate(np.bincount(stream, minlength=hyper.vocab_size).tolist())))
    held_tokens = [t for doc in held_docs for t in doc[1:-1]]
    held_bytes_joined = "".join(held_texts).encode()
    baselines = {
        "gzip_9_bits_per_byte": gzip_bits_per_byte(held_bytes_joined),
        "unigram_token_bits_per_byte": unigram_bits_per_byte(
            counts, hyper.vocab_size, held_tokens, held_bytes
        ),
        "unigram_byte_bits_per_byte": unigram_bits_per_byte(
            byte_counts(train_texts), 256, list(held_bytes_joined), held_bytes
        ),
    }
    log.info("baselines", **{k: round(v, 4) for k, v in baselines.items()})

    model = build_model(hyper, tokenizer).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model", parameters=n_params, bf16_mb=round(n_params * 2 / 1e6, 1))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hyper.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hyper.peak_lr,
        betas=hyper.betas,
        fused=device == "cuda",
    )
    step_fn = model
    if device == "cuda" and not args.no_compile:
        step_fn = torch.compile(model)

    data = torch.from_numpy(stream).to(device)
    generator = torch.Generator(device="cpu").manual_seed(hyper.seed)
    tokens_per_step = hyper.batch_size * hyper.seq_len
    curve: dict[str, list] = {"step": [], "train_loss": [], "eval_step": [], "eval_bits_per_byte": []}
    total_steps = hyper.max_steps
    loop_started = time.monotonic()
    timing_started: float | None = None
    step = 0
    while step < total_steps:
        starts = torch.randint(0, len(stream) - hyper.seq_len - 1, (hyper.batch_size,), generator=generator)
        index = starts.to(device)[:, None] + torch.arange(hyper.seq_len + 1, device=device)
        batch = data[index]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total_steps, hyper)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
                logits = step_fn(input_ids=batch[:, :-1]).logits
        except Exception as exc:  # a compile failure must not cost the run: train eagerly instead
            if step_fn is model:
                raise
            log.warning("torch.compile failed; training eagerly", error=repr(exc)[:500])
            step_fn = model
            continue
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hyper.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step == 2:  # compiled and warm: time the next steps
            if device == "cuda":
                torch.cuda.synchronize()
            timing_started = time.monotonic()
        elif timing_started is not None and step == 2 + hyper.timing_steps:
            if device == "cuda":
                torch.cuda.synchronize()
            per_step = (time.monotonic() - timing_started) / hyper.timing_steps
            left = hyper.train_seconds - (time.monotonic() - loop_started)
            # evaluations take time too: about one step's worth each (measured on the H200)
            total_steps = min(hyper.max_steps, step + max(1, int(left / per_step * 0.95)))
            log.info("schedule", seconds_per_step=round(per_step, 4), total_steps=total_steps)
        if step % 10 == 0 or step == total_steps:
            curve["step"].append(step)
            curve["train_loss"].append(loss.item())
        if step % hyper.eval_every == 0 or step == total_steps:
            nll, count = model_nll(model, held_docs, hyper.seq_len, device)
            bpb = nll / math.log(2) / held_bytes
            curve["eval_step"].append(step)
            curve["eval_bits_per_byte"].append(bpb)
            log.info(
                "step",
                step=step,
                of=total_steps,
                train_loss=round(loss.item(), 4),
                held_out_bits_per_byte=round(bpb, 4),
                lr=f"{lr_at(step, total_steps, hyper):.2e}",
                seconds=round(time.monotonic() - loop_started, 1),
            )
    train_seconds = time.monotonic() - loop_started

    nll, count = model_nll(model, held_docs, hyper.seq_len, device)
    figures = {
        "held_out_files": len(held_texts),
        "held_out_bytes": held_bytes,
        "held_out_tokens": count,
        "model_bits_per_byte": nll / math.log(2) / held_bytes,
        "model_nats_per_token": nll / count,
        **baselines,
    }
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, out)
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=args.max_shard_size)
    report = {
        "figures": figures,
        "training": {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "steps": step,
            "tokens_seen": step * tokens_per_step,
            "train_seconds": round(train_seconds, 1),
            "total_seconds": round(time.monotonic() - started, 1),
            "parameters": n_params,
            "compiled": step_fn is not model,
        },
        "corpus": {
            "roots": [name for name, _ in roots],
            "missing_packages": missing,
            "train_files": len(train_texts),
            "train_bytes": train_bytes,
            "train_tokens": len(stream),
            "split_seed": SPLIT_SEED,
            "held_out_per_mille": HELD_OUT_PER_MILLE,
        },
        "hyper": asdict(hyper),
        "curve": curve,
    }
    report_dir = Path(args.report_dir or out)
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    try:
        plot_curve(curve, hyper, figures, report_dir / "loss_curve.png")
    except ImportError:  # matplotlib is the `bench` extra: the model and training.json are written
        log.warning("no matplotlib: loss_curve.png not written (pip install 'pagedserve[bench]')")
    log.info("done", output=str(out), **{k: round(v, 4) for k, v in figures.items()})
    return report


def plot_curve(curve: dict, hyper: Hyper, figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = hyper.batch_size * hyper.seq_len / 1e6
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s * tokens for s in curve["step"]], curve["train_loss"], lw=0.8, label="train loss (nats/token)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("nats per token")
    ax2 = ax.twinx()
    ax2.plot(
        [s * tokens for s in curve["eval_step"]],
        curve["eval_bits_per_byte"],
        "o-",
        color="tab:red",
        label="held-out bits per byte",
    )
    ax2.axhline(figures["gzip_9_bits_per_byte"], color="gray", ls="--", label="gzip -9 (held-out)")
    ax2.set_ylabel("bits per byte")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right")
    ax.set_title("pagedserve built-in model: training on local Python source")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.train_default_model", description=__doc__)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="a tiny model and corpus (CPU smoke test)")
    parser.add_argument("--output", required=True, help="model directory to write")
    parser.add_argument("--draft-of", default=None, help="train a draft model with this model's tokenizer")
    parser.add_argument("--report-dir", default=None, help="where loss_curve.png and training.json go")
    parser.add_argument("--train-seconds", type=float, default=None, help="override the time budget")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile on CUDA")
    parser.add_argument("--max-shard-size", default="15MB", help="safetensors shard size (copy limits)")
    args = parser.parse_args(argv)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
