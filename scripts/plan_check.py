"""`pagedserve plan`'s KV pool against the executor's real one, on a GPU, at several utilizations.

Each utilization runs `pagedserve plan --measure --json` in a fresh process: the plan (an estimate of
what the executor's profiling measures) and then the executor's own `ModelRunner.create` on the same
flags (profiling pass, pools, CUDA graphs), as a started executor would. Prints one row per
utilization (blocks planned and measured, and the estimate's parts beside the measured ones) and
writes every report to --result-file.

    python -m scripts.plan_check --model /tmp/llama-8b-shape --utilizations 0.85,0.90,0.92
    python -m scripts.plan_check --model DIR -- --max-num-seqs 512   # flags after -- go to plan
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from pagedserve.common.tables import render_table

GIB = 1 << 30
TOLERANCE = 0.01  # the bar: within 1%


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.plan_check", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model directory with weights")
    p.add_argument(
        "--utilizations", default="0.85,0.90,0.92", help="comma-separated --gpu-memory-utilization"
    )
    p.add_argument("--result-file", type=Path, default=Path("bench-results/plan-check.json"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per utilization")
    p.add_argument("plan_args", nargs=argparse.REMAINDER, help="after --: more `pagedserve plan` flags")
    args = p.parse_args(argv)
    extra = [a for a in args.plan_args if a != "--"]
    reports, rows, worst = [], [], 0.0
    for utilization in args.utilizations.split(","):
        command = [sys.executable, "-m", "pagedserve.cli", "plan", "--model", args.model, "--measure",
                   "--json", "--gpu-memory-utilization", utilization, *extra]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            print(f"plan_check: utilization {utilization} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        report = json.loads(proc.stdout)
        reports.append(report)
        m = report["measured"]
        worst = max(worst, abs(m["error"]))

        def both(key: str, m=m) -> str:
            if m.get(key) is None:
                return "n/a"
            return f"{m['planned_' + key] / GIB:.3f} / {m[key] / GIB:.3f}"

        rows.append([
            utilization, f"{m['planned_num_gpu_blocks']:,}", f"{m['num_gpu_blocks']:,}", f"{m['error']:+.3%}",
            both("peak_bytes"), both("graph_reserve_bytes"), both("non_torch_bytes"),
        ])  # fmt: skip
    header = ["utilization", "planned blocks", "measured blocks", "error", "peak GiB (plan / real)",
              "graphs GiB", "outside torch GiB"]  # fmt: skip
    print(render_table(f"pagedserve plan vs the executor: {reports[0]['model']}", header, rows))
    verdict = "within" if worst <= TOLERANCE else "NOT within"
    print(f"largest error {worst:.3%}: {verdict} {TOLERANCE:.0%}")
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps(reports, indent=2) + "\n")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
