"""The documentation's reference pages, generated from the code so that they cannot drift: every flag
of every `pagedserve` command (from the argparse parsers the commands themselves use,
`pagedserve.cli.command_parsers`) and every Prometheus metric (from the registries the services
serve, filled from stand-in state).

`mkdocs build` calls these through scripts/mkdocs_hooks.py; to look at the pages without a build:

    python -m scripts.docs_reference --output /tmp/reference
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

CLI_PAGE = "reference/cli.md"
METRICS_PAGE = "reference/metrics.md"

_CLI_INTRO = """# Command-line reference

Every flag of every `pagedserve` command, generated from the parsers the commands use (see
`pagedserve.cli.command_parsers`), so this page lists exactly what `pagedserve COMMAND --help`
accepts. Names follow vLLM's where the concept is the same. `pagedserve serve` takes the
executor's and the scheduler's own flags (it reuses their definitions) and forwards them to its
children; see [Getting started](../getting-started.md) for what each command is for.

| command | what it runs |
| --- | --- |
{summary}
"""

_SUMMARY = {
    "serve": "executors, one scheduler and (with `--openai-port`) the OpenAI gateway as processes on "
    "loopback; restarts an executor that dies",
    "scheduler": "the scheduler service alone (`python -m pagedserve.scheduler`)",
    "executor": "the executor service alone (`python -m pagedserve.executor`)",
    "openai": "the OpenAI-compatible HTTP gateway in front of one or more schedulers",
    "generate": "a streaming gRPC client: prints one completion as it arrives",
    "health": "a `grpc.health.v1` check: exit 0 when the service is SERVING",
    "executors": "a scheduler's executors (`Admin.ListExecutors`) as a table",
    "bench": "the load generator: workloads W1-W5 against a server, launched services or in-process",
    "bench --log-likelihood": "bits per byte of held-out text scored through the executor",
    "make-model": "writes a random-weight benchmark model (the llama-8b shape)",
}


def _anchor(command: str) -> str:
    return "pagedserve-" + command.replace(" --", "-").replace(" ", "-")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off" if action.default is False else "on"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    if action.default == "":
        return '`""`'
    if isinstance(action.default, list | tuple):
        return ", ".join(f"`{v}`" for v in action.default) or ""
    return f"`{action.default}`"


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    if action.metavar:
        return f"`{action.metavar}`"
    type_name = getattr(action.type, "__name__", "")
    return {"int": "integer", "float": "number"}.get(type_name, "string" if not action.type else "value")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    text = parser._get_formatter()._expand_help(action)
    return _cell(text)


def command_section(words: str, parser: argparse.ArgumentParser) -> str:
    """One command's section: its usage and one table per argument group."""
    lines = [f"## `pagedserve {words}` {{#{_anchor(words)}}}", ""]
    if parser.description:
        lines += [_cell(parser.description.strip().splitlines()[0]), ""]
    usage = parser.format_usage().strip().removeprefix("usage: ")
    lines += ["```text", usage, "```", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = group.title or "options"
        lines += [f"**{title}**", "", "| flag | value | default | meaning |", "| --- | --- | --- | --- |"]
        for action in actions:
            names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
            lines.append(f"| {names} | {_value(action)} | {_default(action)} | {_help(parser, action)} |")
        lines.append("")
    return "\n".join(lines)


def cli_reference() -> str:
    from pagedserve.cli import command_parsers

    parsers = command_parsers()
    summary = "\n".join(
        f"| [`pagedserve {words}`](#{_anchor(words)}) | {_SUMMARY.get(words, '')} |" for words in parsers
    )
    sections = [command_section(words, parser) for words, parser in parsers.items()]
    return _CLI_INTRO.format(summary=summary) + "\n" + "\n".join(sections)


def flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` (what the reference must list), -h/--help aside."""
    return {s for a in parser._actions if not isinstance(a, argparse._HelpAction) for s in a.option_strings}


# ---- metrics -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricDoc:
    name: str  # as exposed (counters with _total; histograms as their base name)
    type: str
    labels: tuple[str, ...]
    help: str


def _docs(registry) -> list[MetricDoc]:
    docs = []
    for family in registry.collect():
        labels: list[str] = []
        for sample in family.samples:
            labels += [k for k in sample.labels if k not in labels and k not in ("le", "quantile")]
        name = family.name + "_total" if family.type == "counter" else family.name
        docs.append(MetricDoc(name, family.type, tuple(labels), family.documentation))
    return docs


def scheduler_registry():
    """The scheduler's registry (scheduler.metrics.SchedulerMetrics) over an engine stand-in with
    one executor, so that every series has a sample to show its labels."""
    from dataclasses import fields

    from pagedserve.scheduler.core import SchedulerStats
    from pagedserve.scheduler.metrics import SchedulerMetrics
    from pagedserve.scheduler.replica import ExecutorStatusView

    def zeros(cls, **values):
        return cls(**{f.name: values.get(f.name, 0) for f in fields(cls)})

    executor = zeros(ExecutorStatusView, address="127.0.0.1:50061", attached=True, state="attached")
    stats = zeros(SchedulerStats, spec_accepted_per_pos=(0,))  # one position: its label shows
    engine = SimpleNamespace(core_stats=lambda: stats, executor_statuses=lambda: [executor])
    return SchedulerMetrics(engine, "MODEL").registry


def executor_registry():
    """The executor's registry (executor.metrics) over a runner stand-in."""
    from pagedserve.executor.metrics import executor_registry as registry
    from pagedserve.executor.runner import RunnerStats

    runner = SimpleNamespace(
        stats=RunnerStats(), kv_cache=SimpleNamespace(num_device_blocks=0, num_cpu_blocks=0), num_requests=0
    )
    return registry(runner, "MODEL")


def gateway_registry():
    """The OpenAI gateway's registry after one request, so that its labelled series have samples."""
    from pagedserve.entrypoints.openai.metrics import GatewayMetrics
    from pagedserve.protos import generation_pb2

    metrics = GatewayMetrics()
    metrics.first_token("completions", 0.1)
    metrics.finished("completions", 200, 0.2, generation_pb2.Usage(prompt_tokens=1, completion_tokens=1))
    return metrics.registry


REGISTRIES = (
    (
        "Scheduler",
        "scheduler",
        scheduler_registry,
        "Served on the scheduler's `--metrics-port` (`pagedserve serve --metrics-port P`: port P). Names "
        "are vLLM's with the `pagedserve:` prefix instead of `vllm:`; every series has a `model_name` "
        "label (`--served-model-name`, else `--model`). Source: `scheduler/metrics.py`.",
    ),
    (
        "Executor",
        "executor",
        executor_registry,
        "Served on the executor's own `--metrics-port` (`pagedserve serve --metrics-port P`: port P + 1, "
        "or `--executor-metrics-port`); label `model_name` (the executor's `--model`). Source: "
        "`executor/metrics.py`.",
    ),
    (
        "OpenAI gateway",
        "gateway",
        gateway_registry,
        "Served by `pagedserve openai` at `GET /metrics` on its HTTP port. Source: "
        "`src/pagedserve/entrypoints/openai/metrics.py`.",
    ),
)


def metric_docs() -> dict[str, list[MetricDoc]]:
    """Every metric of each registry, by its key (scheduler, executor, gateway)."""
    return {key: _docs(build()) for _, key, build, _ in REGISTRIES}


def metrics_reference() -> str:
    docs = metric_docs()
    lines = [
        "# Metrics reference",
        "",
        "Every Prometheus metric pagedserve serves, generated from the services' own registries. "
        "Counters are listed with the `_total` suffix they are scraped with; a histogram `NAME` is "
        "scraped as `NAME_bucket`, `NAME_sum` and `NAME_count`. How to turn them on, sample PromQL and "
        "what to alert on: [Operations](../operations.md#prometheus-metrics).",
        "",
    ]
    for title, key, _, intro in REGISTRIES:
        lines += [
            f"## {title}",
            "",
            intro,
            "",
            "| name | type | labels | meaning |",
            "| --- | --- | --- | --- |",
        ]
        for m in docs[key]:
            labels = ", ".join(f"`{label}`" for label in m.labels)
            lines.append(f"| `{m.name}` | {m.type} | {labels} | {_cell(m.help)} |")
        lines.append("")
    return "\n".join(lines)


PAGES = {CLI_PAGE: cli_reference, METRICS_PAGE: metrics_reference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.docs_reference", description=__doc__)
    parser.add_argument("--output", type=Path, required=True, help="directory to write the pages into")
    args = parser.parse_args(argv)
    for page, render in PAGES.items():
        path = args.output / page
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render())
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
