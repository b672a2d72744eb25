"""`pagedserve bench`: a load generator for a running server, in the spirit of `vllm bench serve`.

It streams token-id prompts through the public gRPC API from its own process (one asyncio event
loop, one channel, many concurrent streams), measures latency per request on the client and
reads the scheduler's counters (Admin.GetStats) before and after each pass. The presets W1, W2
and W3 generate the workloads of docs/performance/index.md exactly.

    pagedserve bench --workload W1 --port 50051
    pagedserve bench --launch --model DIR --workload W2 --compare-prefix-caching
    pagedserve bench --launch --model DIR --workload W3 --request-rates 2,8,32
    pagedserve bench --launch --model DIR --workload W1 --baseline hf-static --baseline-num-prompts 128

Modules, in the order a run uses them: workloads -> client (one pass over gRPC) -> metrics ->
launch (services as processes) -> baselines (Hugging Face) -> report (table, JSON, plot) -> cli.
"""

from pagedserve.bench.baselines import _baseline_summary, run_hf_cb, run_hf_static
from pagedserve.bench.cli import build_parser, main, resolve
from pagedserve.bench.client import PassResult, RequestRecord
from pagedserve.bench.metrics import compare_outputs, server_metrics, summarize
from pagedserve.bench.report import baseline_table, results_table, write_plot
from pagedserve.bench.workloads import (
    BenchRequest,
    LengthRange,
    Workload,
    arrival_times,
    generate_requests,
    token_id_range,
)

__all__ = [
    "BenchRequest",
    "LengthRange",
    "PassResult",
    "RequestRecord",
    "Workload",
    "_baseline_summary",
    "arrival_times",
    "baseline_table",
    "build_parser",
    "compare_outputs",
    "generate_requests",
    "main",
    "resolve",
    "results_table",
    "run_hf_cb",
    "run_hf_static",
    "server_metrics",
    "summarize",
    "token_id_range",
    "write_plot",
]
