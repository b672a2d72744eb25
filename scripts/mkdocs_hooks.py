"""MkDocs hooks (mkdocs.yml `hooks:`): the pages that are generated, not written.

* reference/cli.md and reference/metrics.md, rendered from the code by scripts/docs_reference.py
  (every flag of every command, every Prometheus metric), so the reference cannot drift;
* benchmarks/README.md (the index of the committed results) and everything under
  benchmarks/results/ (each folder's README and raw files), so the guide links to the measurement
  behind each figure and `--strict` checks those links too.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # hooks are loaded by path; scripts/ is the checkout's package
    sys.path.insert(0, str(ROOT))

from scripts import docs_reference  # noqa: E402


def on_files(files: Files, config) -> Files:
    for page, render in docs_reference.PAGES.items():
        files.append(File.generated(config, page, content=render()))
    # The index links into docs/ from the repository's root (../docs/x.md); in the site it sits
    # beside those pages (../x.md).
    index = (ROOT / "benchmarks" / "README.md").read_text().replace("](../docs/", "](../")
    files.append(File.generated(config, "benchmarks/README.md", content=index))
    for path in sorted((ROOT / "benchmarks" / "results").rglob("*")):
        if path.is_file():
            # The result folders' READMEs are pages reached from the index, not from the nav.
            inclusion = InclusionLevel.NOT_IN_NAV if path.suffix == ".md" else InclusionLevel.UNDEFINED
            uri = path.relative_to(ROOT).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path), inclusion=inclusion))
    return files
