"""Experiment trackers rank 0 logs to (``log.trackers``): TensorBoard, Weights & Biases, MLflow.

One small class per tracker behind one interface: ``log(step, values)`` for each metrics line
(eval loss included), ``files(paths)`` for the report's plots, ``close(finished)``. The resolved
config is each run's parameters. A tracker's run id is kept in ``RUN/trackers.json``, so a resumed
or restarted run continues the same tracker run (W&B ``resume="allow"`` with a fixed id, MLflow the
same run id) instead of starting a new one. Each tracker reads its own environment, and allhands'
defaults fill only what is unset: W&B its ``WANDB_*`` settings (``WANDB_DIR`` default the run
directory, ``WANDB_PROJECT`` default ``allhands``, ``WANDB_MODE`` default offline without an API
key), MLflow ``MLFLOW_TRACKING_URI`` (default: a file store in ``RUN/mlruns``) and
``MLFLOW_EXPERIMENT_NAME`` (default: ``run.name``).
"""

from __future__ import annotations

import json
import math
import netrc
import os
import secrets
import sys
import time
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from allhands.errors import first_line
from allhands.safefs import write_private

# The module a tracker needs, named as its pip extra is. TensorBoard is not checked: it is the
# default, and is skipped when not installed, as it was before log.trackers.
_MODULES = {"wandb": "wandb", "mlflow": "mlflow"}
IDS_FILE = "trackers.json"


def selected(trackers: Sequence[str], tensorboard: bool = True) -> list[str]:
    """The trackers a run logs to: ``log.trackers`` without repeats, less tensorboard when the
    older switch ``log.tensorboard`` is false."""
    return [t for t in dict.fromkeys(trackers) if t != "tensorboard" or tensorboard]


def not_installed(trackers: Sequence[str]) -> str | None:
    """One line naming the pip extra of the first selected tracker whose package is missing."""
    from importlib.util import find_spec

    for name in trackers:
        module = _MODULES.get(name)
        try:
            found = module is None or find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-removed install
            found = False
        if not found:
            return (f"log.trackers: {name} is not installed; pip install 'allhands[{name}]' or "
                    f"leave {name} out of log.trackers")
    return None


def tracker_environment(trackers: Sequence[str], environ: MutableMapping[str, str]) -> list[str]:
    """Settle the trackers' own environment before any worker starts (the launcher passes
    ``os.environ``; workers inherit it). Returns the lines to print.

    W&B with neither an API key nor ``WANDB_MODE`` would prompt for a key, or wait on a network
    that a cluster node may not have: it logs offline instead. MLflow's default store is a file
    store in the run directory, which MLflow 3 refuses unless ``MLFLOW_ALLOW_FILE_STORE`` is set
    (it steers users to a database; the file store needs no server, no SQLAlchemy and no schema
    migrations, which take seconds on each new store).
    """
    lines = []
    if "wandb" in trackers:
        if not environ.get("WANDB_PROJECT"):
            environ["WANDB_PROJECT"] = "allhands"
        if not environ.get("WANDB_MODE") and not _wandb_key(environ):
            environ["WANDB_MODE"] = "offline"
            where = str(Path(environ["WANDB_DIR"]) / "wandb") if environ.get("WANDB_DIR") else "RUN/wandb"
            lines.append(f"allhands: wandb: no API key and no WANDB_MODE: logging offline to "
                         f"{where} (upload it later with `wandb sync {where}/offline-run-*`)")
    if "mlflow" in trackers and not environ.get("MLFLOW_TRACKING_URI"):
        environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return lines


def _wandb_key(environ: MutableMapping[str, str]) -> bool:
    """Whether W&B has an API key: ``WANDB_API_KEY``, or the netrc entry `wandb login` writes."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    path = environ.get("NETRC") or str(Path(environ.get("HOME") or Path.home()) / ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics line, less its step and its flags (``resumed``, ...)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 3e-3}}`` -> ``{"optim.lr": 3e-3}``: the config as run parameters."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def files(self, paths: Sequence[Path]) -> None: ...

    def close(self, finished: bool) -> None: ...


class TensorBoard:
    """Events in RUN/tensorboard: a scalar per metric, the report's plots as images."""

    def __init__(self, writer: Any):
        self._tb = writer

    @classmethod
    def open(cls, run_dir: Path, entry: dict, config: dict | None) -> "TensorBoard | None":
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional, and slow to import
        except ImportError:  # tensorboard is optional; the default skips it when missing
            return None
        return cls(SummaryWriter(log_dir=str(run_dir / "tensorboard")))

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self._tb.add_scalar(k, v, step)

    def files(self, paths: Sequence[Path]) -> None:
        from matplotlib.image import imread  # the report's dependency, only when it is made

        for p in paths:
            self._tb.add_image(f"report/{p.stem}", imread(p), dataformats="HWC")

    def close(self, finished: bool) -> None:
        self._tb.close()


class WandB:
    """A W&B run with a fixed id (resumed with ``resume="allow"``), its x axis our step."""

    def __init__(self, run: Any):
        self._run = run

    @classmethod
    def open(cls, run_dir: Path, entry: dict, config: dict | None) -> "WandB":
        import wandb  # optional dependency, imported only on rank 0 when the tracker is on

        entry.setdefault("id", secrets.token_hex(4))
        # The run directory is only the default: wandb.init's dir= would override WANDB_DIR, so it
        # is passed only when WANDB_DIR is unset (W&B reads the variable itself).
        where = None if os.environ.get("WANDB_DIR") else str(run_dir)
        # console="off": W&B would otherwise wrap stdout/stderr, under the progress bar and the
        # launcher's lines; no system-stats sampler thread beside the training loop.
        run = wandb.init(id=entry["id"], resume="allow", dir=where, name=run_dir.name,
                         settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        if config is not None:
            # a resumed run may change a value (--set run.steps=...): the latest config wins
            run.config.update(config, allow_val_change=True)
        # A resumed run logs again from its checkpoint's step, below W&B's own counter, which W&B
        # would drop; plotted against our "step", every line lands at its step.
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return cls(run)

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log({**values, "step": step})

    def files(self, paths: Sequence[Path]) -> None:
        import wandb  # optional dependency, as above

        art = wandb.Artifact("report", type="report")
        for p in paths:
            art.add_file(str(p))
        self._run.log_artifact(art)

    def close(self, finished: bool) -> None:
        self._run.finish(exit_code=0 if finished else 1)


class MLflow:
    """An MLflow run, through the client API (no global active run in the worker)."""

    def __init__(self, client: Any, run_id: str, training: bool):
        self._client, self._run_id, self._training = client, run_id, training

    @classmethod
    def open(cls, run_dir: Path, entry: dict, config: dict | None) -> "MLflow":
        # optional dependency, imported only on rank 0 when the tracker is on
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME, MLFLOW_TRACKING_URI
        from mlflow.tracking import MlflowClient

        # The store the run began in; None for the default, RUN/mlruns wherever the run directory
        # is now (MLflow itself keeps the artifacts' location as an absolute path).
        if "tracking_uri" not in entry:
            entry["tracking_uri"] = MLFLOW_TRACKING_URI.get() if MLFLOW_TRACKING_URI.is_set() else None
        uri = entry["tracking_uri"] or (run_dir / "mlruns").resolve().as_uri()
        client = MlflowClient(tracking_uri=uri)
        if "run_id" in entry:
            if config is not None:  # training again, not the report
                client.update_run(entry["run_id"], status="RUNNING")
        else:
            name = MLFLOW_EXPERIMENT_NAME.get() or (config or {}).get("run", {}).get("name", "allhands")
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
            entry["run_id"] = client.create_run(exp_id, run_name=run_dir.name).info.run_id
        tracker = cls(client, entry["run_id"], training=config is not None)
        if config is not None:
            tracker._params(flat(config))
        return tracker

    def _params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param  # optional dependency, as above

        # MLflow refuses to change a logged parameter: a resumed run keeps the values it began
        # with (its config.resolved.toml holds the latest).
        have = self._client.get_run(self._run_id).data.params
        new = [Param(k, str(v)) for k, v in params.items() if k not in have]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 parameters per batch
            self._client.log_batch(self._run_id, params=new[i:i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric  # optional dependency, as above

        ms = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def files(self, paths: Sequence[Path]) -> None:
        for p in paths:
            self._client.log_artifact(self._run_id, str(p), "report")

    def close(self, finished: bool) -> None:
        if self._training:  # the report attaches its plots and leaves the run's status alone
            self._client.set_terminated(self._run_id, "FINISHED" if finished else "KILLED")


_CLASSES = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def read_ids(run_dir: Path) -> dict[str, dict]:
    """``RUN/trackers.json``: each tracker the run logged to, with its run id."""
    try:
        return json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):  # none yet, or damaged: new tracker runs rather than no job
        return {}


class Trackers:
    """The trackers of one run on rank 0. A tracker that fails is reported in one line and
    dropped: metrics.jsonl is the record of the run, and a tracker's server being away must not
    stop the training."""

    def __init__(self, run_dir: Path, names: Sequence[str], config: dict | None,
                 say: Any = print):
        self.run_dir, self._say = run_dir, say
        self.open: dict[str, Tracker] = {}
        ids = read_ids(run_dir)
        for name in names:
            entry = dict(ids.get(name, {}))
            self._try(name, lambda: self._open(name, entry, config))
            if name in self.open:
                ids[name] = entry
        if config is not None and self.open:
            write_private(run_dir / IDS_FILE, json.dumps(ids, indent=1, sort_keys=True) + "\n")

    def _open(self, name: str, entry: dict, config: dict | None) -> None:
        tracker = _CLASSES[name].open(self.run_dir, entry, config)
        if tracker is not None:
            self.open[name] = tracker

    def _try(self, name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # the tracker's own errors (network, store): see the docstring
            self.open.pop(name, None)
            self._say(f"allhands: warning: {name}: {first_line(e)}; no longer logging to {name}")

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            for name, t in list(self.open.items()):
                self._try(name, lambda: t.log(record["step"], values))

    def files(self, paths: Sequence[Path]) -> None:
        for name, t in list(self.open.items()):
            self._try(name, lambda: t.files(paths))

    def close(self, finished: bool) -> None:
        for name, t in list(self.open.items()):
            self._try(name, lambda: t.close(finished))
        self.open.clear()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def attach_report(run_dir: Path, paths: Sequence[Path], environ: MutableMapping[str, str],
                  say: Any = _stderr) -> list[str]:
    """Log the report's plots to the trackers the run logged to (reopening their runs); returns
    the names of those that took them."""
    names = [n for n in read_ids(run_dir) if n in _CLASSES]
    missing = not_installed(names)
    if missing:
        say(f"allhands: warning: {missing}; the plots were not attached")
        names = [n for n in names if not_installed([n]) is None]
    for line in tracker_environment(names, environ):
        say(line)
    trackers = Trackers(run_dir, names, None, say=say)
    trackers.files(paths)
    took = list(trackers.open)
    trackers.close(finished=True)
    return took
