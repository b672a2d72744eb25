"""Text tables: plain ones for the bench's console output, markdown ones for the diagnostics whose
output goes into notes and the README."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(row)]
        return "  ".join(cells).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([f"== {title} ==", line(header), rule, *(line(r) for r in rows)])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table, one row per line."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)
