"""The documentation: the README's quick start runs as written, the generated references list every
flag and every metric, every page is reachable, and the README stays a front door.

Runnable examples are marked in the Markdown with an HTML comment on the line before a fenced block:

* `<!-- test -->` before a ```console block: each `$ ` line (with `\\` continuations) is run with
  bash from the repository's root, and the lines after it, up to the next `$ `, must be its output
  (stdout and stderr together);
* `<!-- test -->` before a ```python block: the block is run with this Python, and the ```text
  block right after it, if any, must be its stdout;
* `<!-- test: exit-status -->`: run, and only the exit status is checked.

They run against one `pagedserve serve --openai-port ...` started for this file, on free ports
substituted for the examples' 50051 and 8000. Outputs are compared after blanking completion ids and
timestamps, so what the README shows is what the built-in model answers on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.services import REPO, _env, free_port

README = REPO / "README.md"
DOCS = REPO / "docs"
EXAMPLE_FILES = (README, DOCS / "getting-started.md")
GENERATED_PAGES = {"reference/cli.md", "reference/metrics.md", "benchmarks/README.md"}
MARKER = re.compile(r"^<!--\s*test(?::\s*(?P<mode>[\w-]+))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")


# ---- extracting the examples -----------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    source: str  # file:line, the test's id
    lang: str  # console or python
    code: str
    expected: str | None  # None: only the exit status counts
    mode: str

    def commands(self) -> list[tuple[str, list[str]]]:
        """A console block's commands, each with the output lines shown after it."""
        commands: list[tuple[str, list[str]]] = []
        lines = self.code.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            if not line.startswith("$ "):
                commands[-1][1].append(line)
                i += 1
                continue
            command = line[2:]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command + "\n" + lines[i]  # bash joins the lines
            commands.append((command, []))
            i += 1
        return commands


def _fenced_blocks(lines: list[str], start: int) -> tuple[str, str, int]:
    """The fenced block starting at or after `start` (blank lines skipped): language, body, next line."""
    i = start
    while i < len(lines) and not lines[i].strip():
        i += 1
    match = FENCE.match(lines[i]) if i < len(lines) else None
    assert match, f"a test marker must precede a fenced block (line {start})"
    body = []
    i += 1
    while not lines[i].startswith("```"):
        body.append(lines[i])
        i += 1
    return match["lang"], "\n".join(body), i + 1


def extract_examples(path: Path) -> list[Example]:
    lines = path.read_text().splitlines()
    examples = []
    for number, line in enumerate(lines):
        marker = MARKER.match(line)
        if not marker:
            continue
        mode = marker["mode"] or "output"
        assert mode in ("output", "exit-status"), f"{path.name}:{number + 1}: unknown marker mode {mode}"
        lang, code, after = _fenced_blocks(lines, number + 1)
        assert lang in ("console", "python"), f"{path.name}:{number + 1}: a {lang!r} block cannot run"
        expected = None
        if lang == "python" and mode == "output" and after < len(lines) and lines[after] == "```text":
            _, expected, _ = _fenced_blocks(lines, after)
        examples.append(Example(f"{path.relative_to(REPO)}:{number + 1}", lang, code, expected, mode))
    return examples


EXAMPLES = [example for path in EXAMPLE_FILES for example in extract_examples(path)]


def normalize(text: str) -> str:
    """What is compared: completion ids and timestamps blanked, trailing spaces and lines dropped."""
    text = re.sub(r'"id":"(chat)?cmpl-[0-9a-f]+"', '"id":"ID"', text)
    text = re.sub(r'"created":\d+', '"created":0', text)
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")


def test_the_readme_marks_its_quick_start_examples():
    """The extractor finds the README's examples: the generate command, the three ways in."""
    readme = [e for e in EXAMPLES if e.source.startswith("README.md")]
    assert len(readme) >= 5
    assert {e.lang for e in readme} == {"console", "python"}
    assert all(e.expected for e in readme if e.lang == "python")
    joined = "\n".join(e.code for e in readme)
    needles = ("pagedserve generate", "GenerationStub", "LLM(", "localhost:8000/v1/completions", "OpenAI(")
    assert all(needle in joined for needle in needles)


# ---- the server the examples run against ------------------------------------------------------


def _uses_the_server(example: Example) -> bool:
    return example.lang == "console" or bool(re.search(r"\b(50051|8000)\b", example.code))


@dataclass(frozen=True)
class Server:
    port: int
    openai_port: int
    metrics_port: int
    executor_metrics_port: int
    # Examples that need no server (the offline LLM one) start with it, to share its start-up time.
    early: dict[str, subprocess.Popen]

    def localize(self, text: str) -> str:
        text = re.sub(r"\b50051\b", str(self.port), text)
        return re.sub(r"\b8000\b", str(self.openai_port), text)


def _ready(server: Server) -> bool:
    from pagedserve.cli import health_status

    try:
        if health_status(f"127.0.0.1:{server.port}", "", timeout=2) != "SERVING":
            return False
        with urllib.request.urlopen(f"http://127.0.0.1:{server.openai_port}/health", timeout=2) as reply:
            return reply.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`make serve`'s command (`pagedserve serve --openai-port 8000`) on free ports, plus metrics."""
    early = {
        e.source: subprocess.Popen(
            [sys.executable, "-c", e.code],
            cwd=REPO,
            env=_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for e in EXAMPLES
        if not _uses_the_server(e)
    }
    server = Server(free_port(), free_port(), free_port(), free_port(), early)
    log_path = tmp_path_factory.mktemp("docs-serve") / "serve.log"
    argv = [
        sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(server.port),
        "--executor-port", str(free_port()), "--openai-port", str(server.openai_port),
        "--metrics-port", str(server.metrics_port),
        "--executor-metrics-port", str(server.executor_metrics_port),
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        while not _ready(server):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pagedserve serve did not come up:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield server
    finally:
        for example in early.values():
            example.kill()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run(argv: list[str] | str, shell: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, shell=shell, executable="/bin/bash" if shell else None, cwd=REPO, env=_env(),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def _console_command(command: str) -> str:
    """A README command as a user runs it after the quick start; `.venv/bin/pagedserve` is this
    environment's when the checkout has no .venv of its own."""
    if "pagedserve" in command and not (REPO / ".venv" / "bin" / "pagedserve").exists():
        command = command.replace(".venv/bin/pagedserve", f"{sys.executable} -m pagedserve.cli")
    return command


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.source for e in EXAMPLES])
def test_example_runs_as_written(server, example):
    if example.lang == "python":
        if example.source in server.early:
            proc = server.early[example.source]
            stdout, stderr = proc.communicate(timeout=240)
            result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        else:
            result = _run([sys.executable, "-c", server.localize(example.code)])
        assert result.returncode == 0, result.stderr[-3000:]
        if example.expected is not None:
            assert normalize(result.stdout) == normalize(example.expected)
        return
    for command, shown in example.commands():
        result = subprocess.run(
            ["/bin/bash", "-c", _console_command(server.localize(command))], cwd=REPO, env=_env(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
        )  # fmt: skip
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}"
        if example.mode == "output":
            assert normalize(result.stdout) == normalize("\n".join(shown)), command


@pytest.mark.slow
def test_every_metric_the_running_services_serve_is_in_the_reference(server):
    """Scraped from the quick start's own server (scheduler, executor, gateway), after requests."""
    from scripts.docs_reference import metrics_reference

    page = metrics_reference()
    urls = (
        f"http://127.0.0.1:{server.metrics_port}/metrics",
        f"http://127.0.0.1:{server.executor_metrics_port}/metrics",
        f"http://127.0.0.1:{server.openai_port}/metrics",
    )
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as reply:
            families = _exposed_families(reply.read().decode())
        assert families, url
        missing = [name for name in families if f"`{name}`" not in page]
        assert not missing, f"{url}: not in the metrics reference: {missing}"


# ---- the generated references -----------------------------------------------------------------


def _reference_sections(page: str) -> dict[str, set[str]]:
    """The flags the CLI reference lists under each `## pagedserve WORDS` heading."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in page.splitlines():
        heading = re.match(r"^## `pagedserve (.+?)`", line)
        if heading:
            current = sections.setdefault(heading[1], set())
        elif current is not None and line.startswith("| `"):
            first_cell = line.split("|")[1]
            current.update(re.findall(r"`(-[\w-]+)`", first_cell))
    return sections


def _help_flags(words: list[str]) -> set[str]:
    """The options `pagedserve WORDS --help` lists (its option lines, not flags its prose mentions),
    through `pagedserve.cli.main`: the parser the command really uses."""
    from pagedserve.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        with pytest.raises(SystemExit) as exit_info:
            main([*words, "--help"])
    assert exit_info.value.code in (0, None), words
    flags = set()
    for line in out.getvalue().splitlines():
        if re.match(r"^ {2}-", line):
            invocation = line.strip().split("  ")[0]
            flags.update(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", invocation))
    return flags - {"-h", "--help"}


def test_cli_reference_lists_every_flag_of_every_command(monkeypatch):
    """Each command's section lists exactly the options `pagedserve WORDS --help` prints, and every
    command has a section."""
    from pagedserve.cli import build_parser, command_parsers
    from scripts.docs_reference import cli_reference

    monkeypatch.setenv("COLUMNS", "400")  # one option per line, however long
    sections = _reference_sections(cli_reference())
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) <= set(sections)
    assert set(sections) == set(command_parsers())
    for words, listed in sections.items():
        from_help = _help_flags(words.split())
        assert from_help, words
        assert listed == from_help, words
    assert "-tp" in sections["executor"] and "-tp" in sections["serve"]


def _exposed_families(exposition: str) -> set[str]:
    """Metric names in Prometheus' text format, counters with their _total suffix."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", exposition, re.M):
        names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return names


def test_metrics_reference_lists_every_metric_of_every_registry():
    from prometheus_client import generate_latest

    from scripts.docs_reference import REGISTRIES, metrics_reference

    page = metrics_reference()
    listed = set(re.findall(r"^\| `([\w:]+)` \|", page, re.M))
    exposed: set[str] = set()
    for _, _, build, _ in REGISTRIES:
        exposed |= _exposed_families(generate_latest(build()).decode())
    assert exposed == listed
    assert len(listed) >= 30


# ---- the pages ---------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """mkdocs.yml with its `!!python/name:` tags read as plain strings."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_reachable_from_the_nav():
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_Loader)
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav))
    written = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert set(nav) == written | GENERATED_PAGES
    assert "scripts/mkdocs_hooks.py" in config["hooks"]


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]


BENCHMARKS = REPO / "benchmarks"
READMES = [README, BENCHMARKS / "README.md", *sorted((BENCHMARKS / "results").glob("*/README.md"))]


@pytest.mark.parametrize("path", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_outside_the_site_resolve(path):
    """The README and the benchmark READMEs are read on the forge too: their relative links must
    name files of the checkout (the docs pages' links are checked by `mkdocs build --strict`)."""
    for link in _relative_links(path):
        target = (path.parent / link.split("#")[0]).resolve()
        assert target.exists(), f"{path.relative_to(REPO)}: {link}"


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    assert "make serve" in README.read_text() and "make test" in README.read_text()


def test_every_result_folder_is_indexed_and_explained():
    index = (REPO / "benchmarks" / "README.md").read_text()
    for folder in sorted(p for p in (REPO / "benchmarks" / "results").iterdir() if p.is_dir()):
        assert (folder / "README.md").exists(), folder.name
        assert f"(results/{folder.name}/README.md)" in index, folder.name


def test_every_architecture_the_loader_accepts_has_a_row():
    """docs/models.md's table of architectures grows with the loader."""
    from pagedserve.executor.loader import SUPPORTED_ARCHITECTURES

    page = (DOCS / "models.md").read_text()
    rows = set(re.findall(r"^\| `(\w+For\w+)` \|", page, re.M))
    assert rows == set(SUPPORTED_ARCHITECTURES)


# Flags of other tools the pages show (docker, kubectl, kubernetes-validate, mkdocs, the stub
# generator), and `--ssl-*` / `--executor-ssl-*` written as families.
OTHER_TOOLS_FLAGS = {
    "--build-arg", "--force-recreate", "--from-literal", "--replicas", "--scale", "--profile", "--strict",
    "--check", "--ssl", "--executor-ssl", "--hypothesis-show-statistics",
}  # fmt: skip


def test_every_flag_the_docs_mention_exists():
    """A flag named in the README, the guide or the benchmark READMEs is one of a pagedserve
    command's, one of the checkout's tools (benchmarks/, scripts/), or another tool's listed above."""
    from pagedserve.cli import command_parsers

    known = {s for parser in command_parsers().values() for a in parser._actions for s in a.option_strings}
    for tool in (*BENCHMARKS.glob("*.py"), *(REPO / "scripts").glob("*.py")):
        known |= set(re.findall(r'"(--[a-z][a-z0-9-]*)"', tool.read_text()))
    pages = [*READMES, *DOCS.rglob("*.md")]
    for page in pages:
        mentioned = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", page.read_text()))
        unknown = sorted(mentioned - known - OTHER_TOOLS_FLAGS)
        assert not unknown, f"{page.relative_to(REPO)} mentions flags nothing defines: {unknown}"


def test_every_metric_the_docs_mention_exists():
    from scripts.docs_reference import metric_docs

    names = {m.name for docs in metric_docs().values() for m in docs}
    for page in [*READMES, *DOCS.rglob("*.md")]:
        for name in re.findall(r"\b(pagedserve(?::|_gateway_)[a-z]+_[a-z_]+)", page.read_text()):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in names or base in names, f"{page.relative_to(REPO)}: {name}"
