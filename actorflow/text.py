"""Text for people: rows of cells as aligned columns (reports and benchmarks print them)."""

from __future__ import annotations

from collections.abc import Sequence


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """One line per row, each cell left-aligned to its column's widest cell, two spaces apart."""
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
