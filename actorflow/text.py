"""Text for people: counted nouns, sizes in bytes, and rows of cells as aligned columns
(reports, errors and benchmarks print them)."""

from __future__ import annotations

from collections.abc import Sequence


def count(n: int, one: str, many: str | None = None) -> str:
    """``n`` and its noun: "1 stage", "2 stages", "4 micro-batches" (``many`` where "s" won't do)."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """One line per row, each cell left-aligned to its column's widest cell, two spaces apart."""
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def size_text(nbytes: float) -> str:
    """Bytes for people: 1536 -> '1.5 KiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}"
