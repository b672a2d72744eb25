"""The documentation's summary plots (docs/img/*.png), drawn from figures measured on one H200 and
committed under benchmarks/results/ (each bar names its folder in docs/performance/results.md).
Regenerate after a new result is committed, then commit the images:

    python -m scripts.docs_plots
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"

# W1 output tok/s on one H200, llama-8b shape (benchmarks/results/...).
W1 = [
    ("HF generate,\nstatic batches", 438, "anchor"),  # shared/bench/WORKLOADS.md
    ("HF continuous\nbatching", 463, "anchor"),
    ("pagedserve\nbf16", 9_372, "2026-11-29-h200-s4"),
    ("pagedserve\nFP8 weights", 13_430, "2026-12-02-h200"),
    ("pagedserve\nFP8 weights + KV", 15_319, "2026-12-02-h200-s2"),
]

# K1 decode: bytes/s against an anchor at the large shapes.
K1_SHAPES = ["(64, 4096)", "(256, 1024)", "(32, 16384)"]
K1_BF16_VS_SDPA = [0.96, 0.95, 0.96]  # 2026-11-29-h200-s5/kernels.txt
K1_FP8_VS_BF16 = [0.96, 0.97, 0.97]  # 2026-12-02-h200-s3/call2-fp8-decode.txt (L2 emptied by reading)
K1_FP8_TRITON_VS_BF16 = [0.65, 0.65, 0.67]  # the same file, the Triton FP8 kernel


def w1_plot(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [n for n, _, _ in W1]
    values = [v for _, v, _ in W1]
    colors = ["#b0b0b0" if kind == "anchor" else "#3f51b5" for _, _, kind in W1]
    bars = ax.bar(names, values, color=colors)
    for bar, value in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:,}", ha="center", va="bottom")
    ax.set_ylabel("output tokens/s")
    ax.set_title("W1: 512 requests at once, Llama-3.1-8B shape, one H200")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def k1_plot(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    xs = range(len(K1_SHAPES))
    series = (
        ("bf16 paged kernel / SDPA on a contiguous cache", K1_BF16_VS_SDPA, "#3f51b5"),
        ("FP8-KV CUDA kernel / bf16 kernel", K1_FP8_VS_BF16, "#009688"),
        ("FP8-KV Triton kernel / bf16 kernel", K1_FP8_TRITON_VS_BF16, "#b0b0b0"),
    )
    for i, (label, values, color) in enumerate(series):
        positions = [x + (i - 1) * width for x in xs]
        ax.bar(positions, values, width, label=label, color=color)
        for x, v in zip(positions, values, strict=True):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"batch, context\n{s}" for s in K1_SHAPES])
    ax.set_ylim(0, 1.4)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_ylabel("KV bytes/s, ratio")
    ax.set_title("K1 decode attention at the large shapes, one H200")
    ax.legend(loc="upper center", fontsize=8, ncol=2, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    IMG.mkdir(parents=True, exist_ok=True)
    w1_plot(IMG / "w1-throughput.png")
    k1_plot(IMG / "k1-bandwidth.png")
    for name in ("w1-throughput.png", "k1-bandwidth.png"):
        print(IMG / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
