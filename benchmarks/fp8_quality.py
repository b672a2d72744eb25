"""FP8 quality on a trained model (issue 18): bits per byte and greedy agreement, each against bf16.

    python -m benchmarks.fp8_quality [--model DIR] [--device cuda] [--result-file F]

Four variants in one process, one after the other: bf16; `--quantization fp8`; `--kv-cache-dtype
fp8`; both. For each:

1. bits per byte of held-out text scored through the executor's own ModelRunner, exactly as
   `pagedserve bench --log-likelihood` does (`bench.loglik`: the same texts, windows and prompt
   logprobs), and its relative difference from bf16's (issue 18's goal: within 1%);
2. greedy completions of `--prompts` prompts (the opening lines of held-out files) through the
   offline `LLM` API, `--max-tokens` tokens each with EOS ignored (every sequence has the same
   length), compared token by token with bf16's: the fraction of sequences that are identical, and
   the fraction of tokens generated before each sequence's first divergence.

Greedy decoding amplifies any difference: once one token differs the rest of the sequence follows
another path, so the second figure counts only the tokens up to that point. With the built-in model
(the default) the held-out files are this machine's (`train_default_model.held_out_texts`): compare
variants of one run, not runs of different machines. FP8 needs a GPU with FP8 support; on the CPU
the executor refuses the flags unless PAGEDSERVE_FP8_REFERENCE=1 (the slow references; for the
smoke test).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.common.default_model import resolve_model

VARIANTS = {
    "bf16": {},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8-both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


@dataclass(frozen=True)
class Agreement:
    """Greedy outputs of one variant against the reference's, prompt by prompt."""

    sequences: int
    identical_sequences: int
    tokens: int
    tokens_before_divergence: int  # summed over sequences: the common prefix with the reference
    mean_first_divergence: float  # token index of the first difference (= length when identical)

    @property
    def identical_sequence_fraction(self) -> float:
        return self.identical_sequences / self.sequences if self.sequences else 1.0

    @property
    def token_agreement(self) -> float:
        return self.tokens_before_divergence / self.tokens if self.tokens else 1.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> Agreement:
    """Compares each output with the reference output of the same prompt; a sequence counts as
    identical only if it has the reference's length too."""
    assert len(outputs) == len(reference), "one output per prompt in both runs"
    prefixes = [common_prefix(a, b) for a, b in zip(outputs, reference, strict=True)]
    identical = sum(a == b for a, b in zip(outputs, reference, strict=True))
    return Agreement(
        sequences=len(outputs),
        identical_sequences=identical,
        tokens=sum(len(b) for b in reference),
        tokens_before_divergence=sum(prefixes),
        mean_first_divergence=sum(prefixes) / len(prefixes) if prefixes else 0.0,
    )


def _line_chunks(text: str, chars: int) -> list[str]:
    """Successive runs of whole lines of at most `chars` characters (a longer line is cut)."""
    chunks, chunk = [], ""
    for line in text.splitlines(keepends=True):
        if chunk and len(chunk) + len(line) > chars:
            chunks.append(chunk)
            chunk = ""
        chunk += line[:chars]
    chunks.append(chunk)
    return [c for c in chunks if c.strip()]


def greedy_prompts(texts: list[str], count: int, chars: int) -> list[str]:
    """`count` prompts of whole lines (at most `chars` characters): the opening lines of successive
    texts, then their next lines, and so on."""
    per_text = [_line_chunks(t, chars) for t in texts]
    prompts = [c[k] for k in range(max(map(len, per_text), default=0)) for c in per_text if k < len(c)]
    if len(prompts) < count:
        raise ValueError(f"the held-out text gives only {len(prompts)} prompts of {count}")
    return prompts[:count]


def _free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bits_per_byte(
    model: str, device: str, dtype: str, flags: dict, texts: list[str], window: int, blocks: int
) -> dict:
    """`pagedserve bench --log-likelihood` for one variant, in this process."""
    from pagedserve.bench.inprocess import executor_config
    from pagedserve.bench.loglik import engine_log_likelihood
    from pagedserve.executor.runner import ModelRunner
    from pagedserve.scheduler.service import load_tokenizer

    args = f"--device {device} --dtype {dtype} --num-gpu-blocks-override {blocks} --swap-space 0"
    args += "".join(f" --{k.replace('_', '-')} {v}" for k, v in flags.items())
    runner = ModelRunner.create(executor_config(model, args))
    try:
        window = min(window, runner.max_model_len - 1, runner.max_num_batched_tokens - 1)
        result = engine_log_likelihood(runner, load_tokenizer(model), texts, window)
    finally:
        del runner
        _free_device_memory()
    return {
        "bits_per_byte": result.bits_per_byte,
        "mean_log_likelihood_per_token": result.mean_log_likelihood,
        "tokens": result.tokens,
        "bytes": result.bytes,
        "window": window,
        "seconds": round(result.seconds, 2),
    }


def greedy_outputs(
    model: str, device: str, dtype: str, flags: dict, prompts: list[str], max_tokens: int, blocks: int
) -> list[list[int]]:
    """Greedy token ids of every prompt through the offline API (its scheduler batches them all)."""
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.entrypoints.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = dict(device=device, dtype=dtype, num_gpu_blocks_override=blocks, swap_space=0, **flags)
    with LLM(model, **engine) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    _free_device_memory()
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(args: argparse.Namespace) -> dict:
    from pagedserve.bench.corpus import held_out_texts

    texts = held_out_texts(args.held_out_bytes)
    if not texts:
        raise SystemExit("no held-out text on this machine (see pagedserve.bench.corpus)")
    prompts = greedy_prompts(texts, args.prompts, args.prompt_chars)
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    if "bf16" not in variants:
        raise SystemExit("--variants must include bf16 (the reference)")
    rows: dict[str, dict] = {}
    reference_outputs: list[list[int]] = []
    for name in ["bf16", *(v for v in variants if v != "bf16")]:
        flags = VARIANTS[name]
        started = time.perf_counter()
        common = (args.model, args.device, args.dtype, flags)
        row = bits_per_byte(*common, texts, args.window, args.num_gpu_blocks)
        outputs = greedy_outputs(*common, prompts, args.max_tokens, args.num_gpu_blocks)
        if name == "bf16":
            reference_outputs = outputs
        agree = agreement(outputs, reference_outputs)
        base = rows.get("bf16", row)["bits_per_byte"]
        row |= {
            "bpb_rel_diff_vs_bf16": (row["bits_per_byte"] - base) / base,
            "identical_sequences": agree.identical_sequences,
            "sequences": agree.sequences,
            "identical_sequence_fraction": agree.identical_sequence_fraction,
            "token_agreement_before_divergence": agree.token_agreement,
            "agreement": asdict(agree),
            "variant_seconds": round(time.perf_counter() - started, 1),
        }
        rows[name] = row
        print(format_row(name, row), flush=True)
    return {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "held_out_texts": len(texts),
        "variants": rows,
    }


def format_row(name: str, row: dict) -> str:
    return (
        f"{name:12s} bits/byte {row['bits_per_byte']:.5f} "
        f"({row['bpb_rel_diff_vs_bf16'] * 100:+.2f}% vs bf16); "
        f"greedy: {row['identical_sequences']}/{row['sequences']} sequences identical, "
        f"{row['token_agreement_before_divergence'] * 100:.1f}% of tokens before the first divergence"
    )


def markdown_table(result: dict) -> str:
    lines = [
        "| variant | bits per byte | vs bf16 | identical greedy sequences | tokens before first divergence |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["variants"].items():
        lines.append(
            f"| {name} | {row['bits_per_byte']:.4f} | {row['bpb_rel_diff_vs_bf16'] * 100:+.2f}% | "
            f"{row['identical_sequences']}/{row['sequences']} | "
            f"{row['token_agreement_before_divergence'] * 100:.1f}% |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fp8_quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=resolve_model, default="", help="default: the built-in model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--dtype", default="bfloat16", help="the model dtype of every variant (the reference's)"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--held-out-bytes", type=int, default=256 << 10, help="text scored (UTF-8 bytes)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    parser.add_argument("--prompts", type=int, default=32, help="greedy prompts")
    parser.add_argument("--prompt-chars", type=int, default=400, help="characters per prompt (at most)")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument(
        "--num-gpu-blocks", type=int, default=4096, help="KV blocks per variant (a small model needs few)"
    )
    parser.add_argument("--result-file", type=Path, default=None, help="also write the figures as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    for name in ("held_out_bytes", "window", "prompts", "prompt_chars", "max_tokens", "num_gpu_blocks"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    result = run(args)
    print(markdown_table(result))
    if args.result_file is not None:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
