"""The Markdown pieces bench/RESULTS.md is built from (bench/results_md.py, bench/results_tuning.py): a
figure or '-', a table, a section head, a '### heading + table'; and the one text for a GEMV sweep's recheck
(bench.sweep_gemv prints it too; this module imports no torch)."""

from __future__ import annotations

import math


def fmt(x, spec: str, scale: float = 1.0) -> str:
    """`x * scale` formatted with `spec`; '-' for a missing or non-finite figure."""
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x * scale, spec)


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head: list[str], rows: list[list]) -> list[str]:
    return [_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows), ""]


def head(title: str, intro: str) -> list[str]:
    """A section's '## title' and its paragraph saying where the figures come from."""
    return [f"## {title}", "", intro, ""]


def sub(heading: str, cols: list[str], rows: list[list], note: str | None = None) -> list[str]:
    """One '### heading' table, with an optional paragraph (say, which run) between heading and table."""
    return [f"### {heading}", "", *([note, ""] if note else []), *table(cols, rows)]


def recheck_text(rc: dict) -> str:
    """bench.sweep_gemv.recheck's result: today's and the best launch timed again, alternately, after the sweep."""
    return f"{rc['today_median_us']:.1f} vs {rc['best_median_us']:.1f} us: {rc['speedup']:.2f}x"
