"""Experiment trackers with the real packages, offline: an MLflow run (read back through mlflow's
client from the file store in the run directory) holds every logged step's loss and the config as
parameters; a W&B offline run (read back from its transaction log) holds every step too; a resumed
run continues the same tracker runs; the report's plots become artifacts; a tracker that is not
installed is one line before any worker starts; each tracker's own environment variables win over
allhands' defaults (one test per variable, the tracker opened in the test's process)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from allhands.config import Config, apply_override, load_config, to_toml, validate
from allhands.errors import ConfigError
from allhands.launch.launcher import LaunchSpec, train_job
from allhands.trackers import _CLASSES, selected, tracker_environment

from conftest import cli, shared_once, tiny_config
from isolation import shared_root

TRACKED = ["log.tensorboard=true", "log.trackers=tensorboard,mlflow,wandb", "run.eval_interval=2",
           "checkpoint.interval=2", "checkpoint.keep_last=3"]
# Each tracker's own settings, cleared so that the developer's (a W&B key, a tracking server) do
# not reach the test; W&B's caches go to the test's directory.
TRACKER_ENV = ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_BASE_URL", "WANDB_DIR",
               "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME")


def isolate(mp: pytest.MonkeyPatch, home: Path) -> None:
    for k in TRACKER_ENV:
        mp.setenv(k, "")  # recorded, so that undo removes what the run sets
        mp.delenv(k)
    mp.setenv("NETRC", str(home / "no-netrc"))
    for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        mp.setenv(k, str(home / k.lower()))


@pytest.fixture(scope="module")
def tracked(token_dir, tmp_path_factory):
    """One 2-worker run logging to MLflow and W&B with neither configured: 4 steps, eval every 2,
    trained once per test run (whichever pytest worker asks first). The module's tests run in the
    environment it leaves (W&B offline, MLflow's file store)."""
    base = shared_root(tmp_path_factory) / "tracked-home"
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, base)
        cfg = tiny_config(token_dir, base, *TRACKED)
        tracker_environment(selected(cfg.log.trackers, cfg.log.tensorboard), os.environ)

        def build(directory: Path) -> str:
            return train_job(tiny_config(token_dir, directory / "run", *TRACKED),
                             LaunchSpec(nproc=2)).run.dir
        yield Path(shared_once(tmp_path_factory, "tracked", build))


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids["mlflow"]["tracking_uri"] is None  # the default store: RUN/mlruns
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    return client, ids["mlflow"]["run_id"]


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (``run-ID.wandb``): a 7-byte header
    (``:W&B``, magic, version), then LevelDB's log format, records in 32 KiB blocks, each chunk
    with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # the padding at a block's end
            pos += left
            continue
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def wandb_run(offline_dir: Path) -> tuple[str, dict[str, dict], list[dict]]:
    """(run id, config, history rows) of one offline run directory."""
    (log,) = offline_dir.glob("run-*.wandb")
    run_id, config, rows = "", {}, []
    for rec in wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return run_id, config, rows


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def test_mlflow_run_holds_every_step_and_the_config(tracked):
    run_dir = tracked
    client, run_id = mlflow_run(run_dir)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert history(client, run_id, "loss") == sorted(losses(run_dir).items())
    assert [s for s, _ in history(client, run_id, "loss")] == [1, 2, 3, 4]
    assert history(client, run_id, "eval_loss") == sorted(losses(run_dir, "eval_loss").items())
    assert [s for s, _ in history(client, run_id, "eval_loss")] == [0, 2, 4]
    params = run.data.params
    assert params["optim.lr"] == "0.01" and params["model.n_embd"] == "32"
    assert params["log.trackers"] == "['tensorboard', 'mlflow', 'wandb']"
    assert params["run.dir"] == str(run_dir)


def test_wandb_offline_run_holds_every_step_and_the_config(tracked):
    run_dir = tracked
    ids = json.loads((run_dir / "trackers.json").read_text())
    first = offline_runs(run_dir)[0]
    assert first.name.endswith("-" + ids["wandb"]["id"]), first
    run_id, config, rows = wandb_run(first)
    assert run_id == ids["wandb"]["id"]
    assert config["optim"]["lr"] == 0.01
    assert {r["step"]: r["loss"] for r in rows if "loss" in r} == losses(run_dir)
    assert {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r} == losses(run_dir, "eval_loss")


def test_wandb_without_a_key_logs_offline_and_says_so(tmp_path):
    env = {"NETRC": str(tmp_path / "none"), "HOME": str(tmp_path)}
    (line,) = tracker_environment(["wandb"], env)
    assert env["WANDB_MODE"] == "offline" and "wandb sync" in line
    # a key (the variable or `wandb login`'s netrc entry) or an explicit mode: W&B decides
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password k3y\n")
    for env in ({"WANDB_API_KEY": "k"}, {"WANDB_MODE": "online"}, {"NETRC": str(tmp_path / "netrc")}):
        assert tracker_environment(["wandb"], env) == [] and env.get("WANDB_MODE") != "offline"
    env = {}
    assert tracker_environment(["mlflow"], env) == [] and env["MLFLOW_ALLOW_FILE_STORE"] == "true"
    env = {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}
    tracker_environment(["mlflow"], env)
    assert "MLFLOW_ALLOW_FILE_STORE" not in env


def test_a_resumed_run_continues_the_same_tracker_runs(tracked, token_dir, tmp_path):
    run_dir = tracked
    cut = tmp_path / "cut"  # the finished 4-step run, trained on to 6
    shutil.copytree(run_dir, cut)
    before = json.loads((cut / "trackers.json").read_text())
    cfg = tiny_config(token_dir, cut, *TRACKED, "run.steps=6")
    train_job(cfg, LaunchSpec(nproc=2), resume=str(cut))
    assert json.loads((cut / "trackers.json").read_text()) == before

    client, run_id = mlflow_run(cut)
    experiment = client.get_run(run_id).info.experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment])] == [run_id]  # no second run
    assert [s for s, _ in history(client, run_id, "loss")] == [1, 2, 3, 4, 5, 6]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.params["run.steps"] == "4"  # MLflow keeps the first value

    runs = offline_runs(cut)  # W&B offline: one directory per attempt, all under the same id
    assert len(runs) == 2 and all(r.name.endswith("-" + before["wandb"]["id"]) for r in runs)
    run_id, config, rows = wandb_run(runs[1])
    assert run_id == before["wandb"]["id"] and config["run"]["steps"] == 6
    assert sorted(r["step"] for r in rows if "loss" in r) == [5, 6]


def test_report_plots_become_artifacts(tracked, tmp_path, capfd):
    run = tmp_path / "run"
    shutil.copytree(tracked, run)
    p = cli(["report", run], capfd)
    assert p.returncode == 0, p.stderr
    pngs = sorted(p.name for p in (run / "report").glob("*.png"))
    # the report plotted this run (a loss curve, throughput, step times), so the comparisons
    # below are between lists of real plots, not empty ones
    assert {"loss.png", "throughput.png", "step_time.png"} <= set(pngs), pngs
    assert sorted(Path(line).name for line in p.stdout.splitlines()) == pngs, p.stdout
    client, run_id = mlflow_run(run)
    assert sorted(Path(a.path).name for a in client.list_artifacts(run_id, "report")) == pngs
    assert client.get_run(run_id).info.status == "FINISHED"
    (log,) = offline_runs(run)[-1].glob("run-*.wandb")
    kinds = [r.WhichOneof("record_type") for r in wandb_records(log)]
    assert "artifact" in kinds
    art = next(r.artifact for r in wandb_records(log) if r.WhichOneof("record_type") == "artifact")
    assert sorted(Path(e.path).name for e in art.manifest.contents) == pngs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == sorted(f"report/{Path(p).stem}" for p in pngs)
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (s, pytest.approx(v)) for s, v in sorted(losses(run).items())]


def test_a_tracker_not_installed_is_one_line_before_any_worker(token_dir, tmp_path, cli_env):
    run_dir = tmp_path / "run"
    for name in ("wandb", "mlflow"):
        code = (f"import sys; sys.modules[{name!r}] = None; from allhands.cli import main; "
                f"sys.exit(main(sys.argv[1:]))")
        p = subprocess.run([sys.executable, "-c", code, "train", "--nproc", "2",
                            "--set", f"data.path={token_dir}", "--set", f"run.dir={run_dir}",
                            "--set", f"log.trackers=tensorboard,{name}"],
                           capture_output=True, text=True, env=cli_env, timeout=120)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().splitlines() == [
            f"allhands: error: log.trackers: {name} is not installed; pip install "
            f"'allhands[{name}]' or leave {name} out of log.trackers"]
        assert not run_dir.exists()


def test_log_trackers_is_a_validated_list():
    cfg = Config()
    assert cfg.log.trackers == ["tensorboard"]
    apply_override(cfg, "log.trackers=wandb,mlflow")
    assert cfg.log.trackers == ["wandb", "mlflow"]
    apply_override(cfg, 'log.trackers=["mlflow"]')
    assert cfg.log.trackers == ["mlflow"]
    apply_override(cfg, "log.trackers=[]")
    assert cfg.log.trackers == []
    with pytest.raises(ConfigError, match=r"^log.trackers: expected a list of strings"):
        apply_override(cfg, "log.trackers=[1]")
    apply_override(cfg, "log.trackers=tensorboard,neptune")
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == "log.trackers: 'neptune' is not allowed; allowed: tensorboard, wandb, mlflow"


def test_trackers_round_trip_through_the_resolved_config(tmp_path):
    cfg = load_config(None, ["log.trackers=mlflow,wandb"])
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    assert load_config(tmp_path / "c.toml").log.trackers == ["mlflow", "wandb"]


def test_log_tensorboard_false_leaves_tensorboard_out():
    assert selected(["tensorboard", "wandb", "wandb"]) == ["tensorboard", "wandb"]
    assert selected(["tensorboard", "wandb"], tensorboard=False) == ["wandb"]
    assert selected([], tensorboard=True) == []


def test_every_tracker_name_has_a_class():
    from allhands.config.tree import TRACKERS

    assert set(_CLASSES) == set(TRACKERS)


def test_a_tracker_that_fails_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    from allhands.trackers import Trackers

    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///proc/allhands-mlruns")  # not writable
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    lines: list[str] = []
    trackers = Trackers(tmp_path, ["mlflow"], {"run": {"name": "t"}}, say=lines.append)
    trackers.log({"step": 1, "loss": 2.0})
    trackers.close(finished=True)
    assert trackers.open == {} and len(lines) == 1
    assert lines[0].startswith("allhands: warning: mlflow: ")
    assert lines[0].endswith("; no longer logging to mlflow")


def open_tracker(run_dir: Path, name: str) -> list[str]:
    """What a run does with one tracker, here in the test's process: settle the environment as
    the launcher does, open the tracker, log a step, close. Returns every line it said."""
    from allhands.trackers import Trackers

    lines = tracker_environment([name], os.environ)
    trackers = Trackers(run_dir, [name], {"run": {"name": "t"}}, say=lines.append)
    assert name in trackers.open, lines
    trackers.log({"step": 1, "loss": 2.0})
    trackers.close(finished=True)
    return lines


def wandb_run_record(offline_dir: Path):
    (log,) = offline_dir.glob("run-*.wandb")
    return next(r.run for r in wandb_records(log) if r.WhichOneof("record_type") == "run")


@pytest.fixture
def fresh_wandb():
    """W&B reads its environment once per process (its ``wandb.setup`` singleton), as a worker
    does; a test that changes the environment starts from a new singleton, and leaves none."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


@pytest.mark.parametrize("variable", ["WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE"])
def test_wandb_honours_its_own_environment(variable, tmp_path, monkeypatch, fresh_wandb):
    isolate(monkeypatch, tmp_path)
    run_dir, elsewhere = tmp_path / "run", tmp_path / "wandb-dir"
    run_dir.mkdir()
    elsewhere.mkdir()
    value = {"WANDB_DIR": str(elsewhere), "WANDB_PROJECT": "their-project",
             "WANDB_ENTITY": "their-team", "WANDB_MODE": "disabled"}[variable]
    monkeypatch.setenv(variable, value)
    lines = open_tracker(run_dir, "wandb")
    import wandb

    wandb.teardown()  # as a worker's exit does: W&B's service writes out the run's log
    if variable == "WANDB_MODE":  # allhands' default, offline to RUN/wandb, is not applied
        assert os.environ["WANDB_MODE"] == "disabled" and lines == []
        assert not (run_dir / "wandb").exists() and not list(tmp_path.rglob("run-*.wandb"))
        return
    shown = elsewhere / "wandb" if variable == "WANDB_DIR" else "RUN/wandb"
    assert lines == [f"allhands: wandb: no API key and no WANDB_MODE: logging offline to {shown} "
                     f"(upload it later with `wandb sync {shown}/offline-run-*`)"]
    where = elsewhere if variable == "WANDB_DIR" else run_dir
    (offline,) = (where / "wandb").glob("offline-run-*")
    assert (run_dir / "wandb").exists() == (variable != "WANDB_DIR")
    record = wandb_run_record(offline)
    assert record.project == (value if variable == "WANDB_PROJECT" else "allhands")
    assert record.entity == (value if variable == "WANDB_ENTITY" else "")


@pytest.mark.parametrize("variable", ["MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"])
def test_mlflow_honours_its_own_environment(variable, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    isolate(monkeypatch, tmp_path)
    run_dir, store = tmp_path / "run", tmp_path / "their-store"
    run_dir.mkdir()
    if variable == "MLFLOW_TRACKING_URI":
        monkeypatch.setenv(variable, store.as_uri())
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # their store, their setting
    else:
        monkeypatch.setenv(variable, "their-experiment")
    assert open_tracker(run_dir, "mlflow") == []
    entry = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    if variable == "MLFLOW_TRACKING_URI":
        assert entry["tracking_uri"] == store.as_uri() and not (run_dir / "mlruns").exists()
        client = MlflowClient(tracking_uri=store.as_uri())
    else:
        client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    run = client.get_run(entry["run_id"])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [2.0]
    experiment = client.get_experiment(run.info.experiment_id).name
    assert experiment == ("their-experiment" if variable == "MLFLOW_EXPERIMENT_NAME" else "t")
