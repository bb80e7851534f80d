"""The run directory: validate the config, choose or reuse ``RUN_DIR``, write
``config.resolved.toml``, find the data (the embedded corpus by default), and check and settle
the experiment trackers' environment before any worker starts."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

from allhands.checkpoint import committed
from allhands.config import Config, load_config, to_toml, validate
from allhands.data import prepare_embedded
from allhands.env import cache_dir
from allhands.errors import AllhandsError, ConfigError, cannot_write
from allhands.jobcheck import check_token_data
from allhands.models.resolve import check_tokenizer, resolve_model
from allhands.safefs import owner_problem, write_private
from allhands.trackers import not_installed, selected, tracker_environment


def resolve_run(cfg: Config, *, resume: str | None, world_size: int, multi_node: bool = False,
                write: bool = True, own_data: bool = False) -> Config:
    """Validate, settle the run directory and data path; ``write`` creates the directory and
    config.resolved.toml (the launcher, or rank 0 of a launched script). The model section is
    settled first (a preset's shape, a transformers directory's config.json), so the resolved
    config builds the same model on resume. ``own_data``: the Python API was given the data, so
    no prepared data's tokenizer is compared with checkpoint.init_from's."""
    cfg = resolve_model(cfg, say=_stderr if write else None)
    validate(cfg, world_size=world_size)
    if cfg.checkpoint.init_from:  # its module imports DCP and DTensor: a second of start-up
        from allhands.checkpoint.export import check_init_from

        check_init_from(cfg.checkpoint.init_from)
    trackers = selected(cfg.log.trackers, cfg.log.tensorboard)
    missing = not_installed(trackers)
    if missing:
        raise ConfigError(missing)
    for line in tracker_environment(trackers, os.environ):  # the workers inherit it
        if write:
            print(line, file=sys.stderr, flush=True)
    cfg = Config.from_dict(cfg.to_dict())
    if multi_node and not (resume or cfg.run.dir):
        raise ConfigError("run.dir: a multi-node job needs one run directory on a filesystem every "
                          "node shares; pass --set run.dir=/shared/path")
    if resume:
        run_dir = Path(resume)
    elif cfg.run.dir:
        run_dir = Path(cfg.run.dir)
        if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
            if not (multi_node and _same_job(run_dir, cfg)):
                raise ConfigError(f"run.dir: {str(run_dir)!r} already holds checkpoints; continue it "
                                  f"with --resume {run_dir} or choose another run.dir")
            # A requeued node (or job) runs its original command again (Slurm --requeue, a
            # Kubernetes restart): it rejoins the job it belongs to, which resumes from the
            # last committed checkpoint (the workers check that checkpoint's config).
            print(f"allhands: run.dir {str(run_dir)!r} holds this job's checkpoints: this node "
                  f"rejoins it (a requeued node or job)", file=sys.stderr, flush=True)
            write = False
    else:
        run_dir = Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while run_dir.exists():
            n += 1
            run_dir = run_dir.with_name(run_dir.name.split("+")[0] + f"+{n}")
    run_dir = run_dir.resolve()
    cfg.run.dir = str(run_dir)
    with_data(cfg)
    if not own_data:
        check_tokenizer(cfg)
    check_token_data(cfg.data.path, cfg.model.seq_len, cfg.run.global_batch)
    check_run_dir(run_dir)
    if write:
        _write(run_dir, to_toml(cfg))
    return cfg


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def with_data(cfg: Config) -> Config:
    """``cfg`` with ``data.path`` set to the embedded corpus (prepared once per machine) when
    it names no data."""
    if not (cfg.data.path or cfg.data.mix):
        cfg.data.path = str(prepare_embedded(cache_dir() / "embedded-corpus-v1"))
    return cfg


def _write(run_dir: Path, resolved: str) -> None:
    """Create ``run_dir`` with its config.resolved.toml, or say in one line why it cannot be."""
    created = not run_dir.exists()
    try:
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(run_dir / "config.resolved.toml", resolved)
    except OSError as e:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise ConfigError(f"run.dir: {cannot_write(run_dir, e)}; set run.dir to a writable "
                          f"directory") from None


def completed_step(run_dir: str | os.PathLike, steps: int) -> int | None:
    """The step of ``run_dir``'s newest committed checkpoint when it reached ``steps`` (the
    run is complete: resuming it would train nothing), else None."""
    found = committed(Path(run_dir) / "checkpoints")
    return found[-1][0] if found and found[-1][0] >= steps else None


@contextlib.contextmanager
def removed_if_unstarted(run_dir: Path, created: bool):
    """A start that fails leaves no run directory it created: removed unless a training step was
    logged or a checkpoint committed (then its metrics and logs say what happened)."""
    try:
        yield
    except BaseException:
        metrics = run_dir / "metrics.jsonl"
        stepped = metrics.is_file() and '"loss"' in metrics.read_text(errors="replace")
        if created and not stepped and not committed(run_dir / "checkpoints"):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def check_run_dir(run_dir: Path) -> None:
    """An existing run directory must be this user's and writable by no one else: another user
    could otherwise read the job's data or plant symlinks that redirect its writes."""
    try:
        st = run_dir.stat()
    except (FileNotFoundError, NotADirectoryError):  # not there yet: made below, or said why not
        return
    problem = owner_problem(st, "run.dir:", run_dir)
    if problem:
        raise ConfigError(problem)


def _same_job(run_dir: Path, cfg: Config) -> bool:
    """``run_dir`` was made by this config: the same resolved config up to the fields that
    differ between hosts or launches (threads per worker)."""
    path = run_dir / "config.resolved.toml"
    if not path.is_file():
        return False
    try:
        saved = load_config(path).to_dict()
    except AllhandsError:
        return False
    now = cfg.to_dict()
    local = [("run", "threads"), ("run", "dir")] + ([] if cfg.data.path or cfg.data.mix else [("data", "path")])
    for d in (saved, now):
        for sec, name in local:
            d[sec].pop(name, None)
    return saved == now

