"""`make test`: the suite's two parts, both always run, then one summary of them.

Part 1 runs every test not marked ``serial`` on three pytest-xdist workers; part 2 runs the
``serial`` ones (they time things) alone. The summary at the end names every failed test of
either part, every skipped one with its reason, and the slowest tests, and closes with one
line of counts; the exit status is non-zero when either part failed.

    python tests/suite.py [PYTEST_ARGS...]     # extra arguments go to both parts
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

PARTS = [("parallel", ["-n", "3", "--dist", "worksteal", "-m", "not serial"]),
         ("serial", ["-m", "serial"])]
SLOWEST = 15


def cases(report: Path) -> list[dict]:
    """Each test case of a JUnit XML report: its node id, outcome, seconds and message."""
    if not report.exists():
        return []
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        module, _, cls = path.partition("/Test")
        nodeid = f"{module}.py::" + (f"Test{cls}::" if cls else "") + case.get("name", "")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = ((found.get("message") or "").splitlines() or [""])[0][:200]
                break
        out.append(dict(nodeid=nodeid, outcome=outcome, seconds=float(case.get("time", 0)),
                        message=message))
    return out


def main(argv: list[str]) -> int:
    codes, results = {}, []
    with tempfile.TemporaryDirectory(prefix="allhands-suite-") as tmp:
        for name, args in PARTS:
            report = Path(tmp) / f"{name}.xml"
            print(f"== part {name}: pytest {' '.join(args)}", flush=True)
            codes[name] = subprocess.call([sys.executable, "-m", "pytest", "-q", *args,
                                           f"--junitxml={report}", *argv])
            results += [dict(c, part=name) for c in cases(report)]
    # pytest's 5 is "no tests collected": a part that selects none (a -k filter) has not failed.
    failed_parts = [n for n, c in codes.items() if c not in (0, 5)]
    print("\n== summary of both parts (exit codes: "
          + ", ".join(f"{n} {c}" for n, c in codes.items()) + ")")
    print(f"slowest {SLOWEST}:")
    for c in sorted(results, key=lambda c: -c["seconds"])[:SLOWEST]:
        print(f"  {c['seconds']:7.1f} s  {c['nodeid']}")
    for c in (c for c in results if c["outcome"] == "skipped"):
        print(f"SKIPPED {c['nodeid']}: {c['message']}")
    for c in (c for c in results if c["outcome"] == "failed"):
        print(f"FAILED ({c['part']}) {c['nodeid']}: {c['message']}")
    for n in failed_parts:
        if not any(c["part"] == n and c["outcome"] == "failed" for c in results):
            print(f"FAILED part {n}: pytest exited {codes[n]} (see its output above)")
    count = {o: sum(c["outcome"] == o for c in results) for o in ("passed", "failed", "skipped")}
    print(f"{count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped")
    return 1 if failed_parts else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
