"""What a run reports: progress and a summary on rank 0 (a bar on a terminal; otherwise, for
Slurm logs, nohup, tee or a pipe, a plain line every ``log.progress_s`` seconds, and a line for each
slow start-up phase), ``metrics.jsonl`` (one JSON line per logged step, each rank's step time
included so a straggler is visible), and the same lines to the experiment trackers of
``log.trackers`` (trackers.py). Only rank 0 writes; other ranks pass ``enabled=False``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from allhands.env import worker_env
from allhands.safefs import open_private
from allhands.trackers import Trackers

# A start-up phase (starting the workers, their rendezvous, building the model, loading a
# checkpoint, the first step) this slow gets a line of its own, so a log never sits silent
# without saying where the time goes; quicker ones would only be noise.
SLOW_PHASE_S = 3.0


def slow_phase(what: str, seconds: float) -> str | None:
    """``allhands: WHAT took N s`` when ``seconds`` is at least SLOW_PHASE_S, else None; under
    ``--verbose`` always, to the millisecond, with the time since the command started."""
    env = worker_env()
    if env.verbose:
        since = f" ({time.time() - env.command_at:.3f} s since the command)" if env.command_at else ""
        return f"allhands: {what} took {seconds:.3f} s{since}"
    return f"allhands: {what} took {seconds:.1f} s" if seconds >= SLOW_PHASE_S else None


def duration(seconds: float) -> str:
    """``45s``, ``3m 20s``, ``2h 05m``: an ETA as a reader takes it in at a glance."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s // 60 % 60:02d}m"


def progress_line(record: dict[str, Any], total: int, eta_s: float) -> str:
    """The plain progress line of a step record: step/total, loss, the rate named by the data,
    MFU when known, and the ETA."""
    rate, unit = throughput(record)
    step = record["step"]
    parts = [f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)", f"loss {record['loss']:.4f}",
             f"{rate:,.0f} {unit}"]
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    return "allhands: " + ", ".join(parts + [f"ETA {duration(eta_s)}"])


class MetricsWriter:
    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, start_step: int = 0,
                 progress: bool = True, progress_s: float = 0.0,
                 trackers: Sequence[str] = ("tensorboard",), config: dict[str, Any] | None = None):
        self.enabled, self.total = enabled, total_steps
        self.t0 = time.perf_counter()
        # plain lines (no terminal, or no tqdm: a bare machine with torch alone): every
        # progress_s seconds; the ETA from the steps of this run
        bar = progress and sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None
        self.progress_s = progress_s if progress and not bar else 0.0
        self._said_at = self.t0
        self._first: tuple[float, int] | None = None  # (time, step) of the first step record
        self.last: dict[str, Any] = {}
        self.first_eval: float | None = None
        self.last_eval: float | None = None
        self._file = self._bar = self._trackers = None
        if not enabled:
            return
        self._file = open_private(run_dir / "metrics.jsonl", "a", buffering=1)
        if bar:
            from tqdm import tqdm  # optional: only for the bar

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr, disable=None)
        # after the bar, so that a tracker's warning goes above it
        self._trackers = Trackers(run_dir, trackers, config if config is not None else {},
                                  say=self.message)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if "loss" in record:
            self.last = record
        if "eval_loss" in record:
            self.last_eval = record["eval_loss"]
            if self.first_eval is None:
                self.first_eval = record["eval_loss"]
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._trackers.log(record)
        if self._bar is not None and "loss" in record:
            self._bar.n = record["step"]
            rate, unit = throughput(record)
            mfu = {"mfu": f"{100 * record['mfu']:.1f}%"} if "mfu" in record else {}
            self._bar.set_postfix({"loss": f"{record['loss']:.3f}", unit: f"{rate:,.0f}", **mfu},
                                  refresh=False)
            self._bar.refresh()
        if self.progress_s and "loss" in record:
            self._plain(record)

    def _plain(self, record: dict[str, Any]) -> None:
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, record["step"])
        if now - self._said_at < self.progress_s:
            return
        self._said_at = now
        t, step = self._first
        left = self.total - record["step"]
        per_step = (now - t) / (record["step"] - step) if record["step"] > step else record["step_time"]
        print(progress_line(record, self.total, left * per_step), file=sys.stderr, flush=True)

    def message(self, text: str | None) -> None:
        """Print ``text`` above the progress bar on rank 0; None or "" says nothing."""
        if not self.enabled or not text:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self, summary: bool = True) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._trackers.close(finished=summary)
        self._file.close()
        if summary and self.last:
            wall = time.perf_counter() - self.t0
            parts = [f"steps {self.last.get('step')}", f"wall {wall:.1f}s",
                     f"last loss {self.last.get('loss', float('nan')):.4f}"]
            if self.first_eval is not None:
                parts.append(f"eval loss {self.first_eval:.4f} -> {self.last_eval:.4f}")
            rate, unit = throughput(self.last)
            if rate == rate:  # not NaN: the record has a rate
                parts.append(f"{rate:,.0f} {unit}")
            if "mfu" in self.last:
                parts.append(f"MFU {100 * self.last['mfu']:.1f}% "
                             f"({self.last['achieved_flops'] / 1e12:.3g} TFLOP/s)")
            print("allhands: done: " + ", ".join(parts), file=sys.stderr, flush=True)


def throughput(record: dict[str, Any]) -> tuple[float, str]:
    """The rate a step record names by what the data is: tokens/s for token data (the record has
    ``tokens_per_s``), samples/s otherwise (images, tabular rows)."""
    if "tokens_per_s" in record:
        return record["tokens_per_s"], "tokens/s"
    return record.get("samples_per_s", float("nan")), "samples/s"


def iface_tx_bytes(iface: str | None) -> int | None:
    """Bytes this host sent on ``iface`` (kernel counter), or None for loopback or no counter.

    Loopback is left out: on one machine it carries every other job's traffic too.
    """
    if not iface or iface == "lo":
        return None
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None
