"""`allhands drill --chaos` end to end, as a user runs it: a short seeded run on the embedded
corpus (no data.path) whose plan holds a kill inside a checkpoint write and a SIGKILL of the
launcher (which takes that kill's restart with it: the drill's resume recovers both), then the
invariant checker's table, every rule kept."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from conftest import ALLHANDS, ROOT, TINY


def test_a_short_seeded_chaos_drill_keeps_every_invariant(cli_env):
    # A short run directory: the drill makes the job's TMPDIR in it, and multiprocessing's socket
    # path there must fit AF_UNIX's 108 bytes (pytest-xdist's tmp_path does not leave room)
    base = Path(tempfile.mkdtemp(prefix="ahc-", dir="/tmp"))
    try:
        _drill(base, cli_env)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _drill(base: Path, cli_env: dict) -> None:
    sets = [f"--set={s}" for s in (*TINY, "run.steps=12", "checkpoint.interval=2", "fault.hang_timeout_s=3",
                                   "fault.backoff_s=0.1", f"run.dir={base / 'c'}")]
    r = subprocess.run([*ALLHANDS, "drill", "--nproc", "2", "--chaos", "20", "--seed", "1", *sets],
                       capture_output=True, text=True, env=cli_env, timeout=300, cwd=ROOT)
    out = r.stdout.splitlines()
    assert out[1:3] == ["  step 9: ckpt (rank 1)", "  step 11: launcher-SIGKILL (rank 1)"], r.stdout
    rules = ("ends", "commits", "parameters", "faults", "leftovers", "silence")
    table = {w[0]: w[1] for w in map(str.split, out) if len(w) > 1 and w[0] in rules}
    assert table == dict.fromkeys(rules, "yes"), r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "1 relaunch(es) after a killed launcher" in r.stdout
