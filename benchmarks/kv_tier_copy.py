"""The CPU tier's copy bandwidth against the host link's, in one run (on a GPU).

    python -m benchmarks.kv_tier_copy [--result-file bench-results/kv-tier-copy.json]

The tier moves blocks with the executor's own `KVCache.swap_out` (GPU -> host, on eviction) and
`KVCache.swap_in` (host -> GPU, on a hit): a gather of scattered device blocks into block-major
host runs, and back. The anchor is the link itself: one contiguous pinned host <-> device copy of
the same bytes. Cases: a W6 conversation's history (144 blocks), a batch of them (1,024 blocks),
with host blocks in one run (a fresh tier) or scattered (an old tier's LRU order). The layout is
the llama-8b shape's (32 layers, 8 KV heads of 128, bf16, 16 tokens: 2 MiB a block).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from pagedserve.common.tables import render_table
from pagedserve.executor.kv_cache import KVCache, KVCacheLayout

LAYOUT = KVCacheLayout(layers_per_block=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS = 4096, 2048
CASES = [(144, "run"), (144, "scattered"), (1024, "run"), (1024, "scattered")]


def _time_ms(fn, reps: int = 20) -> float:
    """Median of `reps` calls, each between CUDA events (after two warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _measure(cache: KVCache, num_blocks: int, host_order: str, generator: torch.Generator) -> dict:
    """One case's four copies of the same bytes: the tier's two and the link's two."""
    device_ids = torch.randperm(NUM_DEVICE_BLOCKS, generator=generator)[:num_blocks].tolist()
    host_ids = list(range(num_blocks))
    if host_order == "scattered":
        host_ids = torch.randperm(NUM_HOST_BLOCKS, generator=generator)[:num_blocks].tolist()
    nbytes = num_blocks * LAYOUT.bytes_per_block
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=cache.device)
    figures = {
        "swap_out_ms": _time_ms(lambda: cache.swap_out(device_ids, host_ids)),
        "swap_in_ms": _time_ms(lambda: cache.swap_in(host_ids, device_ids)),
        "link_d2h_ms": _time_ms(lambda: host.copy_(on_device, non_blocking=True)),
        "link_h2d_ms": _time_ms(lambda: on_device.copy_(host, non_blocking=True)),
    }
    gbps = {k.removesuffix("_ms"): nbytes / (v * 1e-3) / 1e9 for k, v in figures.items()}
    return dict(blocks=num_blocks, host_order=host_order, bytes=nbytes, **figures, gb_per_s=gbps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kv_tier_copy needs a CUDA device")
    cache = KVCache(LAYOUT, NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS, torch.device("cuda"))
    generator = torch.Generator().manual_seed(0)
    results = [_measure(cache, n, order, generator) for n, order in CASES]
    rows = []
    for r in results:
        g = r["gb_per_s"]
        rows.append([
            f"{r['blocks']} blocks, host {r['host_order']}", f"{r['bytes'] / 2**20:,.0f}",
            f"{g['swap_out']:.1f}", f"{g['link_d2h']:.1f}", f"{g['swap_out'] / g['link_d2h']:.2f}",
            f"{g['swap_in']:.1f}", f"{g['link_h2d']:.1f}", f"{g['swap_in'] / g['link_h2d']:.2f}",
        ])  # fmt: skip
    header = [
        "case", "MiB", "offload GB/s", "link d2h GB/s", "ratio", "load GB/s", "link h2d GB/s", "ratio",
    ]  # fmt: skip
    print(render_table("CPU tier copies (KVCache.swap_out / swap_in) vs the pinned host link", header, rows))
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}; llama-8b-shape blocks of 2 MiB")
    if args.result_file is not None:
        args.result_file.write_text(json.dumps({"device": name, "cases": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
