"""Every figure in BENCHMARKS.md's tables comes from a result file: each table sits in a marked
region that is exactly what ``loadtest.tables.bench_tables`` renders from the files (so a hand-edited
figure fails here), no table lies outside a region, and every number in a rendered data cell is a
number of the result files that table reads, at the cell's own rounding (so a renderer cannot
carry a figure of its own either)."""

from __future__ import annotations

import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest

from loadtest.tables import tables_results
from loadtest.tables.bench_tables import BENCHMARKS_MD, REGION, RESULTS_MD, TABLES, regions, render, rewrite
from loadtest.tables.table_format import CommitMissing, Results

TEXT = BENCHMARKS_MD.read_text()
RESULTS = Results()
# Tables whose figures are not measurements: the summary's goals are the issues' targets and its
# statuses are checked by the region test; the GPU profiles are computed from cluster/engine/profiles.py.
NOT_FROM_FILES = {"summary", "gpu-profiles"}
# A number in a cell: digits with optional thousands separators and decimals, optionally signed,
# not part of a word (``p95``, ``anthropic_529``, ``issue 17``'s label is in the first column).
NUMBER = re.compile(
    r"(?<![\w.])[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.,])[+-]?\d+(?:\.\d+)?(?![\w])"
)


def _render(name: str, results: Results) -> str:
    try:
        return render(name, results)
    except CommitMissing as exc:  # an earlier run's file, read from git: absent in a shallow clone
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_marked_table_is_what_its_result_files_render(name: str) -> None:
    assert regions(TEXT).get(name) == _render(name, RESULTS), (
        f"BENCHMARKS.md's table '{name}' differs from its result files. A table's figures come from "
        "loadtest/results/*.json: run python -m loadtest.tables.bench_tables (never edit a figure by hand)"
    )


def test_every_renderer_has_its_region_and_no_table_is_outside_one() -> None:
    assert set(regions(TEXT)) == set(TABLES)
    outside = [line for line in REGION.sub("", TEXT).splitlines() if line.lstrip().startswith("|")]
    assert not outside, f"tables outside a <!-- table:NAME --> region: {outside[:3]}"


def test_rewrite_replaces_only_the_regions() -> None:
    doc = "prose 13.2 %\n<!-- table:hedging -->\n| made | up |\n<!-- /table:hedging -->\nmore prose\n"
    out = rewrite(doc, RESULTS)
    assert out.startswith("prose 13.2 %\n<!-- table:hedging -->\n| leg | variant |")
    assert out.endswith("<!-- /table:hedging -->\nmore prose\n")
    assert rewrite(out, RESULTS) == out
    with pytest.raises(KeyError, match="nope"):
        rewrite("<!-- table:nope -->\n<!-- /table:nope -->", RESULTS)


def test_a_table_whose_file_is_missing_keeps_its_text_and_is_reported(tmp_path: Path) -> None:
    (tmp_path / "loadtest" / "results").mkdir(parents=True)
    doc = "<!-- table:hedging -->\n| old |\n<!-- /table:hedging -->\n"
    with pytest.raises(FileNotFoundError):
        rewrite(doc, Results(tmp_path))
    failures: dict[str, str] = {}
    assert rewrite(doc, Results(tmp_path), failures) == doc
    assert list(failures) == ["hedging"] and "hedging.json" in failures["hedging"]


def _numbers(obj: Any) -> list[float]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int | float):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _numbers(v)]
    return []


def _rounded(x: float, digits: int) -> Decimal:
    return Decimal(repr(x)).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)


def _cells(body: str) -> list[str]:
    """The data cells of a table but its first (label) column: no header, no separator row."""
    rows = [line for line in body.splitlines() if line.startswith("|")][2:]
    return [cell for row in rows for cell in row.strip("|").split("|")[1:]]


def _in_files(token: str, percent: bool, pool: list[float]) -> bool:
    value = Decimal(token.replace(",", "").lstrip("+"))
    digits = len(token.split(".")[1]) if "." in token else 0
    candidates = [x * 100 for x in pool] + pool if percent else pool
    return any(_rounded(x, digits) == value or _rounded(-x, digits) == value for x in candidates)


@pytest.mark.parametrize("name", sorted(set(TABLES) - NOT_FROM_FILES))
def test_every_figure_in_a_table_is_a_number_of_its_result_files(name: str) -> None:
    reader = Results()  # a fresh reader: which files (and commits) this table reads
    body = regions(TEXT)[name]
    _render(name, reader)
    pool = [x for key in reader.read() for x in _numbers(reader.get(*key))]
    missing = [
        (cell.strip(), token)
        for cell in _cells(body)
        for m in NUMBER.finditer(cell)
        if not _in_files(token := m.group(), cell[m.end() :].lstrip().startswith("%"), pool)
    ]
    files = ", ".join(f"{n}.json" + (f"@{at}" if at else "") for n, at in reader.read())
    assert not missing, f"table '{name}': figures in no result file it reads ({files}): {missing[:5]}"


def test_the_figure_check_catches_an_invented_figure() -> None:
    pool = _numbers(json.loads('{"a": 0.1318, "b": 245.5, "c": [7455.5]}'))
    assert (
        _in_files("13.2", True, pool) and _in_files("245.5", False, pool) and _in_files("7,456", False, pool)
    )
    assert _in_files("246", False, pool)  # 245.5 rounded half up
    assert not _in_files("13.3", True, pool) and not _in_files("245", False, pool)
    assert [
        m.group()
        for m in NUMBER.finditer("p95 TTFT 200 ms, anthropic_529, 1,674 mean, +0.71, 19–30")  # noqa: RUF001
    ] == [
        "200",
        "1,674",
        "+0.71",
        "19",
        "30",
    ]


RESULTS_TEXT = RESULTS_MD.read_text()


@pytest.mark.parametrize("name", sorted(tables_results.TABLES))
def test_every_results_md_table_is_what_its_result_files_render(name: str) -> None:
    assert regions(RESULTS_TEXT).get(name) == render(name, RESULTS, tables_results.TABLES), (
        f"RESULTS.md's table '{name}' differs from its result files: "
        "run python -m loadtest.tables.bench_tables"
    )


def test_results_md_has_every_table_no_table_outside_one_and_fits_a_page() -> None:
    assert set(regions(RESULTS_TEXT)) == set(tables_results.TABLES)
    outside = [line for line in REGION.sub("", RESULTS_TEXT).splitlines() if line.lstrip().startswith("|")]
    assert not outside, f"tables outside a <!-- table:NAME --> region: {outside[:3]}"
    assert len(RESULTS_TEXT.splitlines()) <= 150
    prose = REGION.sub("", RESULTS_TEXT)
    assert not re.findall(r"\d+(?:\.\d+)?\s*(?:ms|\u00d7|%|µs|tok/s)", prose), (
        "a figure typed by hand in RESULTS.md"
    )


@pytest.mark.parametrize("name", sorted(tables_results.TABLES))
def test_every_ours_and_peer_figure_in_results_md_is_a_number_of_its_result_files(name: str) -> None:
    reader = Results()
    body = regions(RESULTS_TEXT)[name]
    tables_results.TABLES[name](reader)
    pool = [x for key in reader.read() for x in _numbers(reader.get(*key))]
    rows = [line.strip("|").split("|") for line in body.splitlines() if line.startswith("|")][2:]
    cells = [row[i] for row in rows for i in tables_results.FROM_FILES]
    missing = [
        (cell.strip(), token)
        for cell in cells
        for m in NUMBER.finditer(cell)
        if not _in_files(token := m.group(), cell[m.end() :].lstrip().startswith("%"), pool)
    ]
    assert not missing, f"RESULTS.md table '{name}': figures in no result file it reads: {missing[:5]}"


def test_benchmarks_md_is_a_reference_not_a_diary() -> None:
    """Issue 46: the reference page stays readable (history lives in git, not on the page)."""
    assert len(TEXT.encode()) <= 60_000, f"BENCHMARKS.md is {len(TEXT.encode()):,} bytes: keep it ≤ 60,000"
