"""What a run reports: a progress bar and a summary on rank 0, ``metrics.jsonl`` (one JSON line per
logged step, each rank's step time included so a straggler is visible) and TensorBoard events
when tensorboard is installed. Only rank 0 writes; other ranks pass ``enabled=False``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from allhands.safefs import open_private


class MetricsWriter:
    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, start_step: int = 0,
                 progress: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.last: dict[str, Any] = {}
        self.first_eval: float | None = None
        self.last_eval: float | None = None
        self._file = self._bar = self._tb = None
        if not enabled:
            return
        self._file = open_private(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr, disable=None)

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
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self._tb.add_scalar(k, v, record["step"])
        if self._bar is not None and "loss" in record:
            self._bar.n = record["step"]
            rate, unit = throughput(record)
            mfu = {"mfu": f"{100 * record['mfu']:.1f}%"} if "mfu" in record else {}
            self._bar.set_postfix({"loss": f"{record['loss']:.3f}", unit: f"{rate:,.0f}", **mfu},
                                  refresh=False)
            self._bar.refresh()

    def message(self, text: str) -> None:
        if not self.enabled:
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
        if self._tb is not None:
            self._tb.close()
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
