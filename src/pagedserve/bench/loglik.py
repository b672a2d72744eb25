"""`pagedserve bench --log-likelihood`: the quality of the engine's numerics, as bits per byte.

    pagedserve bench --log-likelihood [--model DIR] [--held-out-bytes N] [--executor-args "..."]

It scores held-out Python source (the built-in model's held-out files, see
`pagedserve.bench.corpus`) through the executor's own ModelRunner, driven in this process by
plans built here: every text is cut into windows, each window is a request whose prompt logprobs
(`Sampling.return_prompt_logprobs`) give log p(token | tokens before it). The mean log-likelihood
per token and the bits per byte are then exactly what the kernels, the dtype (fp8...) and the
batching compute, so a numeric change can be judged by quality as well as by speed. With the
built-in model, the same figures computed by Hugging Face in training.json are the reference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagedserve.common.default_model import DEFAULT_MODEL_DIR, resolve_model
from pagedserve.protos import executor_pb2


@dataclass(frozen=True)
class LogLikelihood:
    """Summed over every scored token: the first token of each text (its <s>, or its first token
    for a tokenizer without one) has no prediction and is not counted."""

    nll_nats: float
    tokens: int
    bytes: int
    seconds: float

    @property
    def mean_log_likelihood(self) -> float:
        return -self.nll_nats / self.tokens

    @property
    def bits_per_byte(self) -> float:
        return self.nll_nats / math.log(2) / self.bytes


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Windows of `size` + 1 tokens overlapping by one, so every token after the first is predicted
    exactly once (the scheme of the training script's evaluation)."""
    return [ids[start : start + size + 1] for start in range(0, len(ids) - 1, size)]


def score_windows(runner, requests: list[list[int]]) -> tuple[float, int]:
    """Runs each token list as a prompt through `runner` (whole prompts, packed into steps up to the
    token budget, sequence limit and free blocks) and sums -log p of every token after the first.

    Returns:
        (summed negative log-likelihood in nats, number of tokens scored).
    """
    block_size = runner.block_size
    free = list(range(runner.kv_cache.num_device_blocks))
    sampling = executor_pb2.Sampling(temperature=0.0, return_prompt_logprobs=True)
    nll, scored, step_id, pending = 0.0, 0, 0, list(enumerate(requests))
    held: dict[int, list[int]] = {}
    while pending or held:
        step_id += 1
        plan = executor_pb2.StepPlan(step_id=step_id, removed_seq_ids=list(held))
        for blocks in held.values():
            free.extend(blocks)
        held.clear()
        budget = runner.max_num_batched_tokens
        while pending and len(held) < runner.max_num_seqs:
            seq_id, ids = pending[0]
            need = -(-len(ids) // block_size)
            if len(ids) > budget or need > len(free):
                break
            pending.pop(0)
            blocks = [free.pop() for _ in range(need)]
            held[seq_id] = blocks
            budget -= len(ids)
            plan.new_requests.add(
                seq_id=seq_id, token_ids=ids, num_new_tokens=len(ids),
                block_tables=[executor_pb2.BlockTable(block_ids=blocks)], sampling=sampling,
                num_prompt_tokens=len(ids),
            )  # fmt: skip
        if pending and not held and not plan.removed_seq_ids:
            raise ValueError(f"a window of {len(pending[0][1])} tokens does not fit the executor's limits")
        output = runner.execute(plan)
        for p in output.prompt_logprobs:
            nll -= sum(p.logprobs)
            scored += len(p.logprobs)
    return nll, scored


def engine_log_likelihood(runner, tokenizer, texts: list[str], window: int) -> LogLikelihood:
    """Scores `texts` (each tokenized with the tokenizer's special tokens, as the scheduler does)."""
    started = time.perf_counter()
    requests = [w for text in texts for w in windows(tokenizer.encode(text), window) if len(w) > 1]
    nll, tokens = score_windows(runner, requests)
    return LogLikelihood(nll, tokens, sum(len(t.encode()) for t in texts), time.perf_counter() - started)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench --log-likelihood", description=__doc__)
    parser.add_argument("--log-likelihood", action="store_true", help="this mode (required)")
    parser.add_argument("--model", type=resolve_model, default="", help="default: the built-in model")
    parser.add_argument(
        "--held-out-bytes", type=int, default=64 << 10, help="text scored (UTF-8 bytes; ~1 min on a CPU)"
    )
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    parser.add_argument(
        "--executor-args", default="", help='executor flags, e.g. "--device cpu --dtype float32"'
    )
    parser.add_argument("--result-file", type=Path, default=None, help="also write the figures as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedserve.bench.corpus import gzip_bits_per_byte, held_out_texts
    from pagedserve.bench.inprocess import executor_config
    from pagedserve.executor.runner import ModelRunner
    from pagedserve.scheduler.service import load_tokenizer

    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.held_out_bytes < 1 or args.window < 1:
        parser.error("--held-out-bytes and --window must be positive")
    config = executor_config(args.model, args.executor_args)
    runner = ModelRunner.create(config)
    window = min(args.window, runner.max_model_len - 1, runner.max_num_batched_tokens - 1)
    texts = held_out_texts(args.held_out_bytes)
    result = engine_log_likelihood(runner, load_tokenizer(args.model), texts, window)
    figures = {
        "model": args.model,
        "builtin_model": Path(args.model) == DEFAULT_MODEL_DIR,
        "device": str(runner.device),
        "dtype": str(runner.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "texts": len(texts),
        "bytes": result.bytes,
        "tokens": result.tokens,
        "window": window,
        "mean_log_likelihood_per_token": round(result.mean_log_likelihood, 5),
        "bits_per_byte": round(result.bits_per_byte, 5),
        "gzip_9_bits_per_byte": round(gzip_bits_per_byte("".join(texts).encode()), 5),  # the anchor
        "seconds": round(result.seconds, 1),
    }
    print(json.dumps(figures, indent=1))
    if args.result_file is not None:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(figures, indent=1) + "\n")
    return 0
