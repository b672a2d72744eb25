"""Hugging Face transformers baselines on the same requests: static batches and continuous batching."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from pagedserve.bench.workloads import BenchRequest


def _load_hf_model(model_dir: str, device: str):
    """The checkpoint, or, for a directory without weights (`pagedserve make-model --no-weights`,
    served with `--load-format dummy`), the config's shape with transformers' own random weights,
    drawn on the device: a throughput baseline does not depend on the values."""
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if any(Path(model_dir).glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    else:
        with torch.device(device):
            config = AutoConfig.from_pretrained(model_dir)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as in the pagedserve pass
    return model, device


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf_static(
    model_dir: str, requests: Sequence[BenchRequest], batch_size: int = 64, device: str = "auto"
):
    """`model.generate` on static, left-padded batches, greedy, each run to its longest output.
    Only each request's own output tokens count as useful; the rest is padding waste."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig

    model, device = _load_hf_model(model_dir, device)
    pad = 0
    useful = generated = input_tokens = 0
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    _sync(device)
    start = time.perf_counter()
    for batch in tqdm(batches, desc="hf-static", unit="batch", file=sys.stderr, leave=False):
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        max_new = max(r.output_len for r in batch)
        config = GenerationConfig(
            max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=pad
        )
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
        steps = out.shape[1] - width
        generated += steps * len(batch)
        useful += sum(min(r.output_len, steps) for r in batch)
        input_tokens += sum(len(r.prompt) for r in batch)
    _sync(device)
    duration = time.perf_counter() - start
    return _baseline_summary("hf-static", len(requests), duration, input_tokens, useful, generated, device)


def run_hf_cb(model_dir: str, requests: Sequence[BenchRequest], device: str = "auto", cb_config=None):
    """transformers' continuous batching (the paged-cache manager `generate_batch` drives), with
    each request's own max_new_tokens and EOS disabled. `cb_config` (a ContinuousBatchingConfig)
    defaults to transformers' defaults, the setting of the README's W1 anchor."""
    import inspect

    from tqdm import tqdm
    from transformers import GenerationConfig

    model, device = _load_hf_model(model_dir, device)
    max_new = max(r.output_len for r in requests)
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)
    kwargs = dict(generation_config=config, block=True, timeout=5, continuous_batching_config=cb_config)
    if "workload_hints" in inspect.signature(model.continuous_batching_context_manager).parameters:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(r.prompt) for r in requests),
            max_generated_length=max_new,
            num_requests=len(requests),
        )
    results = {}
    with model.continuous_batching_context_manager(**kwargs) as manager:
        _sync(device)
        start = time.perf_counter()
        for r in requests:
            manager.add_request(
                list(r.prompt), request_id=f"r{r.index}", max_new_tokens=r.output_len, eos_token_id=-1
            )
        with tqdm(total=len(requests), desc="hf-cb", unit="req", file=sys.stderr, leave=False) as bar:
            while len(results) < len(requests):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                    bar.update(1)
                elif result is None and not manager.is_running():
                    break
        _sync(device)
        duration = time.perf_counter() - start
    useful = sum(len(r.generated_tokens) for r in results.values() if r.error is None)
    input_tokens = sum(len(r.prompt) for r in requests)
    summary = _baseline_summary("hf-cb", len(requests), duration, input_tokens, useful, useful, device)
    summary["failed"] = len(requests) - sum(1 for r in results.values() if r.error is None)
    return summary


def _baseline_summary(name, num, duration, input_tokens, useful, generated, device) -> dict:
    return {
        "system": name,
        "device": device,
        "num_requests": num,
        "failed": 0,
        "duration_s": duration,
        "output_tokens": useful,
        "generated_tokens": generated,
        "padding_waste": 1 - useful / generated if generated else 0.0,
        "output_throughput": useful / duration,
        "total_token_throughput": (input_tokens + useful) / duration,
    }
