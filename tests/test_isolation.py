"""The suite's isolation (tests/isolation.py) under the pinned pytest and pytest-xdist: two
workers never run tests of one exclusive group at once, a shared fixture is built once per run,
and a test that builds a network lab without the mark stops the run at collection."""

from __future__ import annotations

import json
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from isolation import (_exclusive_marked, pytest_collection_modifyitems,  # noqa: F401
                       pytest_configure, shared_once)
"""

# --dist each: every test runs on both workers, at the same time unless a lock keeps them apart.
# The free test first, so that both workers run it together (the control: the two intervals
# overlap, so the check below can see an overlap), then the exclusive one.
TIMED = """
import json, os, time
from pathlib import Path
import pytest
from isolation import shared_once

OUT = Path({out!r})

def _record(name):
    t0 = time.monotonic()
    time.sleep(1.5)
    with open(OUT / f"{{name}}-{{os.environ['PYTEST_XDIST_WORKER']}}.json", "w") as f:
        json.dump([t0, time.monotonic()], f)

@pytest.fixture(scope="session")
def built(tmp_path_factory):
    def build(directory):
        with open(OUT / "builds", "a") as f:
            f.write("built\\n")
        return str(directory)
    return shared_once(tmp_path_factory, "once", build)

def test_a_free():
    _record("free")

@pytest.mark.exclusive({group!r})
def test_b_exclusive(built):
    _record("exclusive")
"""


def _intervals(out: Path, name: str) -> list[list[float]]:
    return [json.loads((out / f"{name}-gw{i}.json").read_text()) for i in (0, 1)]


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_an_exclusive_group_never_runs_on_two_workers_at_once(pytester, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_timed=TIMED.format(out=str(out), group=f"meta-{tmp_path.name}"))
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "each", "-p", "no:cacheprovider",
                                           timeout=120)
    result.assert_outcomes(passed=4)
    assert _overlap(*_intervals(out, "free")), "the control did not run on both workers at once"
    assert not _overlap(*_intervals(out, "exclusive")), _intervals(out, "exclusive")
    assert (out / "builds").read_text() == "built\n"  # once, though both workers asked


def test_a_lab_test_without_the_mark_stops_the_run_at_collection(pytester):
    pytester.makeconftest(CONFTEST)
    builds = "Lab" + '(2, tag="zz", prefix="10.99.0")'  # spelled apart: this file builds none
    pytester.makepyfile(test_lab=f"""
from allhands.netlab import Lab

def test_unmarked():
    with {builds} as lab:
        pass
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    assert result.ret == 4  # pytest's usage error: nothing ran
    result.stderr.fnmatch_lines(["*build a network lab but are not marked*test_lab.py::test_unmarked*"])
