"""Progress as a user sees it with no terminal (a Slurm log, nohup, a pipe): plain progress lines
with step/total and ETA; and the rules behind those lines and the start-up warnings, without
processes."""

from __future__ import annotations

import re
import subprocess

from allhands.launch.launcher import oversubscribed
from allhands.metrics import SLOW_PHASE_S, duration, progress_line, slow_phase

from conftest import ALLHANDS, ROOT, TINY


def test_plain_progress_lines_on_a_pipe_with_step_total_and_eta(token_dir, tmp_path, cli_env):
    """``allhands train`` with stdout and stderr to pipes and a plain line every 0.2 s."""
    sets = [*TINY, "run.steps=30", "log.progress=true", "log.progress_s=0.2", f"data.path={token_dir}",
            f"run.dir={tmp_path / 'run'}"]
    r = subprocess.run([*ALLHANDS, "train", "--nproc", "1", *(x for s in sets for x in ("--set", s))],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env,
                       timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if re.match(r"allhands: step \d+/30 ", ln)]
    assert lines, r.stderr[-3000:]
    pattern = (r"allhands: step (\d+)/30 \(\d+%\), loss \d+\.\d{4}, [\d,]+ tokens/s(, MFU [\d.]+%)?, "
               r"ETA (\d+s|\d+m \d\ds)$")
    assert all(re.match(pattern, ln) for ln in lines), lines
    assert "\r" not in r.stderr and "\x1b[" not in r.stderr  # no bar, no terminal control
    assert "allhands: recovery: up to 3 restart(s)" in r.stderr and "allhands: done: steps 30" in r.stderr


def test_the_plain_line_and_its_eta_read_at_a_glance():
    rec = {"step": 12, "loss": 3.41234, "tokens_per_s": 23456.7, "step_time": 0.5, "mfu": 0.123}
    assert progress_line(rec, 100, 200) == ("allhands: step 12/100 (12%), loss 3.4123, 23,457 "
                                            "tokens/s, MFU 12.3%, ETA 3m 20s")
    images = {"step": 1, "loss": 2.0, "samples_per_s": 99.0, "step_time": 0.1}
    assert progress_line(images, 4, 0.4) == "allhands: step 1/4 (25%), loss 2.0000, 99 samples/s, ETA 0s"
    assert [duration(s) for s in (59.4, 60, 3599, 3600, 7500)] == ["59s", "1m 00s", "59m 59s", "1h 00m",
                                                                  "2h 05m"]
    assert slow_phase("the first step", SLOW_PHASE_S - 0.01) is None
    assert slow_phase("the first step", 7.26) == "allhands: the first step took 7.3 s"


def test_more_workers_than_cores_is_one_warning_with_the_fix():
    assert oversubscribed(2, 2) is None and oversubscribed(1, 16) is None
    w = oversubscribed(16, 2)
    assert w == ("allhands: warning: 16 workers on 2 core(s): each gets about 0.12 of a core and "
                 "every step waits for the slowest; set --nproc 2 or expect slow steps")
