"""``loadtest.benchmarks.bench_all``'s plan and its running logic, without running a benchmark: every result
file has a step (or a reason it has none), every script that writes one is a step, each step's
options are its script's, the quick plan fits the ~40 minutes, a failed step does not stop the
next, the load average is read around each, and a step past its limit is ended with its children."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from loadtest.benchmarks import bench_all
from loadtest.benchmarks.bench_all import NOT_RERUN, STEPS, failed, plan, run_process, run_steps

ROOT = Path(__file__).resolve().parents[2]
LOADTEST = ROOT / "loadtest"
# Scripts that write under loadtest/results but are not steps, and why (paths under loadtest/).
NOT_STEPS = {
    "benchmarks/cli_bench.py": "cluster bench's ad-hoc reports (named per run), on no table of the page",
    "benchmarks/gpu_check.py": "the GPU run (scripts/gpu-check.sh)",
    "benchmarks/bench_all.py": "this runner",
    "common/provenance.py": "writes what each script hands it (write_report), no result file of its own",
    "tables/bench_tables.py": "writes BENCHMARKS.md from the results, no result file",
    "locustfile.py": "Locust's CSVs and summary where its caller says, on no table of the page",
    "calibration/calibrate_host.py": (
        "by hand: configs/local.yaml carries its coefficients (bench_all.NOT_RERUN)"
    ),
    "benchmarks/rehearsal.py": (
        "by hand, as root (network namespaces), ~15 min: past the quick plan's 45 (NOT_RERUN)"
    ),
}


def modules() -> set[str]:
    """Every module in loadtest/ and its packages, as its path under loadtest/."""
    return {p.relative_to(LOADTEST).as_posix() for p in LOADTEST.rglob("*.py")}


def source(module: str) -> Path:
    """A step's module as its file: ``loadtest.a.b`` is loadtest/a/b.py."""
    return ROOT / (module.replace(".", "/") + ".py")


def test_every_result_file_is_rewritten_by_a_step_or_says_why_not() -> None:
    written = {f for s in STEPS for f in s.writes}
    on_disk = {p.name for p in (LOADTEST / "results").glob("*.json")}
    assert on_disk - written - set(NOT_RERUN) == set()
    assert written & set(NOT_RERUN) == set()


def test_every_script_that_writes_a_result_file_is_a_step() -> None:
    steps = {source(s.module).relative_to(LOADTEST).as_posix() for s in STEPS}
    text = {p: (LOADTEST / p).read_text() for p in modules()}
    writers = {p for p, t in text.items() if re.search(r"\bresults\b", t) and "write_text" in t}
    assert writers - steps - set(NOT_STEPS) == set()
    assert steps <= modules()
    assert set(NOT_STEPS) <= modules()  # each exception names a module that is there


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_each_steps_options_are_its_scripts(step: bench_all.Step) -> None:
    text = source(step.module).read_text()
    for opt in {a for a in (*step.full, *(step.quick or ())) if a.startswith("--")}:
        assert f'"{opt}"' in text, f"{step.module} has no option {opt}"


def test_the_quick_plan_fits_forty_five_minutes_and_full_is_never_smaller() -> None:
    assert sum(s.est_s(full=False) for s in STEPS) <= 45 * 60  # 40 until the noisy neighbour joined
    assert all(s.est_s(full=True) >= s.est_s(full=False) for s in STEPS)
    assert [s.args(full=True) for s in STEPS if s.quick is None] == [
        s.args(full=False) for s in STEPS if s.quick is None
    ]


def test_the_calibration_runs_before_the_fidelity_replay_that_reads_it() -> None:
    names = [s.name for s in plan()]
    assert names.index("calibrate") < names.index("fidelity")
    assert [s.name for s in plan(["soak", "planner"])] == ["planner", "soak"]  # the plan's order
    with pytest.raises(ValueError, match="nope"):
        plan(["nope"])


def test_a_failed_step_does_not_stop_the_next_and_load_is_read_around_each() -> None:
    steps = plan(["planner", "faults", "soak"])
    ran: list[Sequence[str]] = []
    outcomes = iter([0, 1, None])  # ok, failed, timed out
    loads = iter([(1.0, 0, 0), (2.0, 0, 0), (3.0, 0, 0), (4.0, 0, 0), (5.0, 0, 0), (6.0, 0, 0)])
    clock = iter(range(100))

    def run(cmd: Sequence[str], timeout_s: float) -> int | None:
        ran.append(cmd)
        assert timeout_s >= 600
        return next(outcomes)

    records = run_steps(steps, full=False, run=run, loadavg=lambda: next(loads), clock=lambda: next(clock))
    assert [r.step for r in records] == ["planner", "faults", "soak"]
    assert [c[2:] for c in ran] == [
        [
            "loadtest.benchmarks.planner_validation",
            "--quick",
            "--host-calibration",
            "loadtest/results/host_cpu.json",
        ],
        ["loadtest.benchmarks.faults", "--markdown"],
        ["loadtest.benchmarks.soak", "--minutes", "0.75"],
    ]
    assert [(r.load_average_before[0], r.load_average_after[0]) for r in records] == [(1, 2), (3, 4), (5, 6)]
    assert failed(records) == ["faults", "soak"]


def test_dry_run_prints_every_step_and_runs_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(*_: object, **__: object) -> None:
        raise AssertionError("a dry run ran a step")

    monkeypatch.setattr(bench_all, "run_steps", boom)
    assert bench_all.main(["--dry-run", "--full"]) == 0
    out = capsys.readouterr().out
    assert all(f"python -m {s.module}" in out for s in STEPS)
    assert "faults --long --markdown" in out and "bench_tables" in out
    assert bench_all.main(["--dry-run", "--only", "nope"]) == 2


def test_a_step_past_its_limit_is_ended_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    t0 = time.monotonic()
    rc = run_process(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout_s=1.0)
    assert rc is None and time.monotonic() - t0 < 20
    child = int(pid_file.read_text())
    for _ in range(50):  # the group got SIGTERM; give the child a moment to go
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the step's child outlived its limit")
    assert run_process(["sh", "-c", "exit 3"], timeout_s=10) == 3


@pytest.mark.parametrize("module", sorted({s.module for s in STEPS}))
def test_each_step_records_its_provenance(module: str) -> None:
    """Each result file says what it measured: commit, load average before and after, machine."""
    text = source(module).read_text()
    assert "provenance(" in text and "git_state()" in text


def test_the_planner_predicts_with_the_host_costs_measured_just_before_it() -> None:
    names = [s.name for s in plan()]
    assert names.index("host") == names.index("planner") - 1
    host = next(s for s in plan() if s.name == "host")
    planner = next(s for s in plan() if s.name == "planner")
    for full in (True, False):
        args = planner.args(full)
        assert args[args.index("--host-calibration") + 1] == f"loadtest/results/{host.writes[0]}"
