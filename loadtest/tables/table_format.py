"""What every BENCHMARKS.md table renderer shares: where a result file is read from (the working
tree, or the file as a past commit holds it, for the tables that keep an earlier run beside the
current one) and how a figure is written. Each renderer states its own rounding per column with
these helpers; none of them invents a figure."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable, Sequence
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "loadtest" / "results"


class CommitMissing(LookupError):
    """The commit a table's earlier run is read from is not in this clone (a shallow one)."""


class Results:
    """Result files by name (``"overhead"`` → ``loadtest/results/overhead.json``), read once each.

    ``at`` names a commit: the file as that commit recorded it (``git show``), for the tables of an
    earlier run; its figures were written by the script then, and the commit is in the table's text.
    """

    def __init__(self, root: Path = ROOT) -> None:
        self.root = root
        self._cache: dict[tuple[str, str | None], dict[str, Any]] = {}

    def get(self, name: str, at: str | None = None) -> dict[str, Any]:
        key = (name, at)
        if key not in self._cache:
            rel = f"loadtest/results/{name}.json"
            if at is None:
                text = (self.root / rel).read_text()
            else:
                shown = subprocess.run(
                    ["git", "show", f"{at}:{rel}"], cwd=self.root, capture_output=True, text=True
                )
                if shown.returncode:
                    raise CommitMissing(
                        f"{rel} at {at}: {shown.stderr.strip()} (a shallow clone? git fetch --unshallow)"
                    )
                text = shown.stdout
            self._cache[key] = json.loads(text)
        return self._cache[key]

    def read(self) -> list[tuple[str, str | None]]:
        """The (file, commit) pairs read so far: which files a table's figures come from."""
        return list(self._cache)

    def exists(self, name: str) -> bool:
        return (self.root / f"loadtest/results/{name}.json").exists()


def _half_up(x: float, digits: int) -> Decimal:
    """The figure as the file writes it (its shortest decimal form), rounded half up: 0.3695 to 3
    decimals is 0.370, 245.5 to none is 246, as a reader rounding the JSON's text would."""
    return Decimal(repr(x)).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)


def fixed(x: float, digits: int) -> str:
    """``digits`` decimals (half up), thousands separated."""
    return f"{_half_up(x, digits):,.{digits}f}"


def signed(x: float, digits: int) -> str:
    """As :func:`fixed`, with its sign (``+5.08``, ``-0.20``)."""
    return f"{_half_up(x, digits):+,.{digits}f}"


def pct(ratio: float, digits: int = 1) -> str:
    """A ratio as a percentage to ``digits`` decimals (half up): 0.1318 → ``13.2%``."""
    return f"{(Decimal(repr(ratio)) * 100).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)}%"


def num(x: float | None) -> str:
    """A count or a value as the file holds it (ints as ints, None as ``-``)."""
    if x is None:
        return "-"
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return f"{x:,}" if isinstance(x, int) else str(x)


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; ``align`` has one letter per column: ``l`` (``---``) or ``r`` (``---:``)."""
    assert len(align) == len(header)
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
    ]
    for row in rows:
        assert len(row) == len(header), row
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
