"""Mistakes a new user makes in the first hour, over the CLI and the Python API: each is one line
naming the cause (exit 2 for invalid input), never a traceback, and leaves no run directory or
output behind. The CLI runs in-process (``cli.main``); a few cases run as real subprocesses."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

import allhands
from allhands.checkpoint import committed
from allhands.cli import main
from allhands.config import Config
from allhands.errors import AllhandsError, ConfigError
from allhands.launch.elastic import describe_failures

from conftest import ALLHANDS, ROOT, cli, tiny_config


@pytest.fixture(scope="module")
def places(tmp_path_factory, token_dir):
    """Files and directories the cases point at, made once: ``{name: path}`` for the ``{name}``
    placeholders of the table."""
    base = tmp_path_factory.mktemp("bad")
    (base / "afile").write_text("not a directory")
    (base / "empty.txt").write_text("")
    (base / "three.txt").write_text("abc")
    (base / "blank.txt").write_text("  \n\n ")
    (base / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (base / "text.txt").write_text("enough text " * 100)
    (base / "surrogate.jsonl").write_text('{"text": "half a pair \\udc80 of UTF-16"}\n'
                                          + '{"text": "enough text here"}\n' * 50)
    (base / "bad.toml").write_text("[run\nsteps = ")
    (base / "emptydir").mkdir()
    (base / "badmetrics").mkdir()
    (base / "badmetrics" / "metrics.jsonl").write_text("{not json\n")
    allhands.data.prepare(["a few sentences of text. " * 40], base / "small_tokens")
    return {"afile": base / "afile", "tokens": token_dir, "base": base,
            **{p.name.replace(".", "_"): p for p in base.iterdir()}}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, token_dir):
    """A complete tiny run (2 steps, committed checkpoint at step 2), trained in this process."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    allhands.train(tiny_config(token_dir, run_dir, "run.steps=2"))
    assert [s for s, _ in committed(run_dir / "checkpoints")] == [2]
    return run_dir


@pytest.fixture(scope="module")
def read_only(tmp_path_factory, finished):
    """A read-only filesystem holding a copy of ``finished``'s metrics (root ignores chmod, so a
    real read-only mount: a tmpfs remounted ro)."""
    mnt = tmp_path_factory.mktemp("ro")
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mnt)], capture_output=True,
                      timeout=60).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        (mnt / "run").mkdir()
        (mnt / "run" / "metrics.jsonl").write_bytes((finished / "metrics.jsonl").read_bytes())
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, timeout=60)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=60)


SUBCOMMANDS = ("train", "drill", "launch", "rendezvous-store", "config", "show", "prepare", "export", "plan",
               "report")
T = ["--set", "log.progress=false", "--set", "data.path={tokens}"]  # nothing heavy before the error
NEW = "{base}/never"  # a run.dir / --out that a failed command must not create

# (argv, exit code, text the one error line holds)
CLI = [
    (["train", "--nproc", "0", *T], 2, "--nproc: 0 is not allowed"),
    (["train", "--nproc", "-3", *T], 2, "--nproc: -3"),
    (["train", "--nproc-per-node", "0", *T], 2, "--nproc: 0"),
    (["train", "--nproc_per_node", "0", *T], 2, "--nproc: 0"),
    (["train", "--nproc", "two"], 2, "invalid int value: 'two'"),
    (["train", "--port", "99999", *T], 2, "--port: 99999"),
    (["train", "--port", "-1", *T], 2, "--port: -1"),
    (["train", "--master-port", "70000", *T], 2, "--port: 70000"),
    (["train", "--master_port", "65536", *T], 2, "--port: 65536"),
    (["train", "--max-restarts", "-1", *T], 2, "--max-restarts: -1"),
    (["train", "--max_restarts", "-5", *T], 2, "--max-restarts: -5"),
    (["train", "--nnodes", "x", *T], 2, "--nnodes: 'x'"),
    (["train", "--nnodes", "2", *T], 2, "--rdzv-endpoint: required"),
    (["train", "--nnodes", "3:2", "--rdzv-endpoint", "h:29400", *T], 2, "--nnodes: minimum 3"),
    (["train", "--node-rank", "5", *T], 2, "--node-rank: 5"),
    (["train", "--node_rank", "-1", *T], 2, "--node-rank: -1"),
    (["train", "--rdzv-endpoint", "hostonly", *T], 2, "is not HOST:PORT"),
    (["train", "--rdzv_endpoint", "h:99999", *T], 2, "is not HOST:PORT"),
    (["train", "--standalone", "--nnodes", "2", "--rdzv-endpoint", "h:1", *T], 2, "--standalone"),
    (["train", "--rdzv-store", "external", *T], 2, "--rdzv-store: external needs"),
    (["train", "--rdzv-store", "nowhere"], 2, "invalid choice: 'nowhere'"),
    (["train", "--bind", "not-an-ip", *T], 2, "--bind: 'not-an-ip'"),
    (["train", "--nproc-pr-node", "2"], 2, "did you mean --nproc-per-node?"),
    (["train", "--stes", "3"], 2, "unrecognized arguments: --stes"),
    (["train", "a.toml", "b.toml"], 2, "unrecognized arguments: b.toml"),
    (["train", "--set", "model.n_layer=0", *T], 2, "model.n_layer"),
    (["train", "--set", "optim.lr=-1", *T], 2, "optim.lr"),
    (["train", "--set", "nosuch.field=1", *T], 2, "nosuch"),
    (["train", "--set", "run.steps", *T], 2, "run.steps"),
    (["train", "--set", "run.steps=many", *T], 2, "run.steps"),
    (["train", "{base}/missing.toml"], 2, "missing.toml"),
    (["train", "{bad_toml}"], 2, "bad.toml"),
    (["train", "--resume", "{base}/nope"], 2, "--resume"),
    (["train", "{bad_toml}", "--resume", "{finished}"], 2, "--resume: takes the run's own config"),
    (["train", "--nproc", "2", *T, "--set", "run.dir={afile}/run"], 2, "is a file, not a directory"),
    (["train", "--nproc", "2", *T, "--set", "run.dir={ro}/run"], 2, "Read-only file system"),
    (["train", "--nproc", "2", "--set", "data.path={small_tokens}", "--set", f"run.dir={NEW}"], 2,
     "training samples of model.seq_len+1=129 tokens, fewer than run.global_batch=32"),
    (["train", "--set", "data.path={base}/nodata", "--set", f"run.dir={NEW}"], 2, "data.path"),
    (["train", "--nproc", "2", *T, "--set", "run.global_batch=7", "--set", f"run.dir={NEW}"], 2,
     "global_batch"),
    (["train", *T, "--set", "parallel.zero=5"], 2, "parallel.zero"),
    (["train", *T, "--set", "run.compile_backend=tvm"], 2,
     "run.compile_backend: 'tvm' is not allowed; allowed: inductor, aot_eager, eager"),
    (["train", *T, "--set", "log.progress_s=-1"], 2, "log.progress_s: -1.0 is not allowed; must be >= 0"),
    (["train", *T, "--set", "checkpoint.init_from={base}/w.safetensors"], 2, "checkpoint.init_from"),
    (["train", *T, "--set", "fault.mode=replica", "--set", "parallel.tp=2"], 2,
     "parallel.tp: 2 is not supported with fault.mode=replica"),
    (["train", *T, "--set", "fault.mode=replica", "--set", "parallel.sync=diloco", "--set", "parallel.dp_shard=2",
      "--set", "parallel.zero=2"], 2, "parallel.dp_shard: 2 is not supported with fault.mode=replica"),
    (["train", *T, "--set", "fault.mode=hot"], 2, "fault.mode: 'hot' is not allowed"),
    (["train", *T, "--set", "fault.mode=replica", "--set", "parallel.sync=ps"], 2,
     "fault.mode: 'replica' is not allowed; replica needs ps.mode=async or ssp"),
    (["train", *T, "--set", "fault.spares=-1"], 2, "fault.spares: -1 is not allowed; must be in [0, 64]"),
    (["train", *T, "--set", "fault.mode=replica", "--set", "fault.spares=1", "--set", "parallel.sync=diloco"], 2,
     "fault.spares: 1 is not allowed; spares replace groups of one data-parallel process"),
    (["drill", "--faults", "0"], 2, "--faults: 0"),
    (["drill", "--nproc", "0", *T], 2, "--nproc: 0"),
    (["drill", "--faultz", "2"], 2, "did you mean --faults?"),
    (["launch", "{base}/nosuch.py"], 2, "nosuch.py"),
    (["launch", "--nproc", "0", f"{ROOT}/examples/user_model.py"], 2, "--nproc: 0"),
    (["launch", "--port", "70000", f"{ROOT}/examples/user_model.py"], 2, "--port: 70000"),
    (["rendezvous-store", "--bind", "nohost"], 2, "--bind: 'nohost'"),
    (["rendezvous-store", "--bind", "127.0.0.1", "--port", "70000"], 2, "--port: 70000"),
    (["rendezvous-store"], 2, "the following arguments are required: --bind"),
    (["config", "show", "--set", "model.dropout=1.5"], 2, "model.dropout"),
    (["config"], 2, "the following arguments are required"),
    (["config", "show", "--dcos"], 2, "did you mean --docs?"),
    (["prepare", "{empty_txt}", "--out", NEW], 2, "hold no text"),
    (["prepare", "{blank_txt}", "--out", NEW], 2, "the input is 6 tokens"),
    (["prepare", "{three_txt}", "--out", NEW], 2, "the input is 4 tokens"),
    (["prepare", "{base}/missing.txt", "--out", NEW], 2, "missing.txt"),
    (["prepare", "{latin1_txt}", "--out", NEW], 2, "is not UTF-8"),
    (["prepare", "{surrogate_jsonl}", "--out", NEW], 2, "lone UTF-16 surrogate"),
    (["prepare", "{text_txt}", "--out", NEW, "--val-fraction", "1.5"], 2, "--val-fraction"),
    (["prepare", "{text_txt}", "--out", "{ro}/tokens"], 2, "Read-only file system"),
    (["prepare", "{text_txt}", "--out", "{afile}/tokens"], 2, "is a file, not a directory"),
    (["prepare", "--out", NEW], 2, "the following arguments are required: INPUT"),
    (["export", "{finished}", "--out", "{base}/m.pt"], 2, "does not end in .safetensors"),
    (["export", "{base}/nope", "--out", f"{NEW}/m.safetensors"], 2, "is not a directory"),
    (["export", "{emptydir}", "--out", f"{NEW}/m.safetensors"], 2, "has no committed checkpoint"),
    (["export", "{finished}", "--step", "99", "--out", f"{NEW}/m.safetensors"], 2, "at step 99"),
    (["export", "{finished}", "--out", "{ro}/m.safetensors"], 2, "Read-only file system"),
    (["export", "{finished}", "--out", "{afile}/m.safetensors"], 2, "is a file, not a directory"),
    (["export", "{finished}"], 2, "the following arguments are required: --out"),
    (["plan", "--model", "nocolon"], 2, "--model: 'nocolon' is not MODULE:BUILDER"),
    (["plan", "--model", "nosuch_module_q:build"], 2, "--model: cannot import 'nosuch_module_q'"),
    (["plan", "--model", "json:nosuch"], 2, "--model: json has no function 'nosuch'"),
    (["plan", "--model", "json:loads"], 2, "--model: building it on the meta device failed: TypeError"),
    (["plan", "--model", "json:loads", "--check"], 2, "--check trains the reference GPT's layouts"),
    (["report", "{base}/nope"], 2, "not found"),
    (["report", "{emptydir}"], 2, "not found"),
    (["report", "{badmetrics}"], 2, "line 1 is not JSON"),
    (["report", "{ro}/run"], 2, "Read-only file system"),
    ([], 2, "the following arguments are required: command"),
    (["trian"], 2, "invalid choice: 'trian'"),
    (["--bogus"], 2, "the following arguments are required: command"),
]


@pytest.mark.parametrize("argv,code,says", CLI, ids=[" ".join(c[0][:3]) for c in CLI])
def test_cli_bad_input_is_one_line(argv, code, says, places, finished, capsys, request, tmp_path,
                                   monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default run.dir (runs/...) would land here, not in the checkout
    fill = dict(places, finished=finished)
    if any("{ro}" in a for a in argv):
        fill["ro"] = request.getfixturevalue("read_only")
    argv = [a.format(**fill) for a in argv]
    before = set(Path.cwd().iterdir())
    r = cli(argv, capsys)
    got, err = r.returncode, r.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    assert got == code, err
    assert len(errors) == 1 and errors[0] == lines[-1] and says in errors[0], err
    if not lines[0].startswith("usage:"):
        assert len(lines) == 1, err  # ours: only that line; argparse's: its usage, then the line
    else:  # the usage of the (sub)command that was given the bad argument
        words = [a for a in argv[:2] if a in SUBCOMMANDS]
        assert lines[0].startswith(" ".join(["usage: allhands", *words]) + " "), err
    assert "Traceback" not in err
    assert not Path(NEW.format(**fill)).exists()
    assert set(Path.cwd().iterdir()) == before  # no runs/... left behind


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1).requires_grad_(False)

    def forward(self, x):
        return self.lin(x)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            x = torch.randn(4, generator=g)
            yield x, x.sum(0, keepdim=True)


def _rows(n: int):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


mse = nn.functional.mse_loss

# (keyword arguments of allhands.train, config overrides, text the one-line error holds)
API = [
    (dict(model=42), [], "model: int is neither an nn.Module nor a builder"),
    (dict(model=lambda: nn.Linear(4, 1)), [], "does not take one argument"),
    (dict(model=lambda cfg: "a model"), [], "the builder returned str, not an nn.Module"),
    (dict(model=Frozen()), [], "Frozen has no trainable parameters"),
    (dict(model=lambda cfg: nn.ReLU()), [], "ReLU has no trainable parameters"),
    (dict(loss=lambda o, t: nn.functional.mse_loss(o, t, reduction="none")), [],
     "loss: returned a tensor of shape (4, 1), not a scalar"),
    (dict(loss=lambda o, t: float(mse(o, t))), [], "loss: returned float, not a scalar tensor"),
    (dict(loss=lambda o, t: mse(o, t).detach()), [], "does not depend on the model's output"),
    (dict(loss=42), [], "loss: pass a function"),
    (dict(loss=lambda o: o.sum()), [], "loss: pass a function"),
    (dict(data=_rows(3)), [], "run.global_batch: 4 is more than the 3 training samples"),
    (dict(data=lambda cfg: (_rows(2), _rows(2))), [], "4 is more than the 2 training samples"),
    (dict(data=42), [], "data: int is neither a map-style dataset"),
    (dict(data=lambda: _rows(8)), [], "data: the builder"),
    (dict(data=Stream(3)), [], "the IterableDataset ended after 3 items but item 3 is needed"),
    (dict(), ["optim.lr=0"], "optim.lr"),
    (dict(), ["run.global_batch=0"], "run.global_batch"),
]


@pytest.mark.parametrize("kw,extra,says", API, ids=[f"api{i}" for i in range(len(API))])
def test_python_api_bad_input_is_one_line(kw, extra, says, tmp_path):
    run_dir = tmp_path / "run"
    cfg = Config.from_dict(Config().to_dict())
    from allhands.config import apply_override
    for item in ("run.steps=3", "run.global_batch=4", "log.progress=false", "log.tensorboard=false",
                 "checkpoint.interval=0", "run.eval_interval=0", f"run.dir={run_dir}", *extra):
        apply_override(cfg, item)
    args = dict(model=lambda cfg: nn.Linear(4, 1), data=_rows(16), loss=mse)
    with pytest.raises(AllhandsError) as e:
        allhands.train(cfg, **{**args, **kw})
    assert e.value.exit_code == 2 and says in str(e.value) and "\n" not in str(e.value)
    assert not run_dir.exists()


def test_resume_of_a_finished_run_says_so_and_writes_nothing(finished, capsys):
    files = {p: p.stat().st_mtime_ns for p in finished.rglob("*")}
    r = cli(["train", "--resume", str(finished)], capsys)
    code, err = r.returncode, r.stderr
    assert code == 0
    assert err.strip() == (f"allhands: {finished} is complete at step 2 (run.steps=2); nothing to "
                           f"do. To train further: allhands train --resume {finished} --set "
                           f"run.steps=4")
    assert {p: p.stat().st_mtime_ns for p in finished.rglob("*")} == files


def test_subprocess_errors_and_version(finished, cli_env, tmp_path):
    def run(*argv):
        return subprocess.run([*ALLHANDS, *argv], capture_output=True, text=True, env=cli_env,
                              cwd=ROOT, timeout=120)

    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith(f"allhands {allhands.__version__} (torch ")
    r = run("train", "--port", "99999")
    assert r.returncode == 2 and r.stderr == "allhands: error: --port: 99999 is not allowed; must " \
        "be in [1, 65535], or 0 for a free one\n"
    out = tmp_path / "m.safetensors"
    r = run("export", str(finished), "--out", str(out))  # no torch warning about a single process
    assert r.returncode == 0 and r.stderr == "" and out.is_file(), r.stderr


@pytest.mark.parametrize("sub,says", [("prepare", ".jsonl[.gz|.zst]"), ("export", "a run directory made by"),
                                      ("report", "RUN_DIR/report"),
                                      ("launch", "your Python script"), ("train", "TOML job config")])
def test_each_subcommand_documents_its_positional_arguments(sub, says, capsys):
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    assert e.value.code == 0 and "positional arguments:" in (out := capsys.readouterr().out) and says in out


def test_the_same_worker_error_on_several_ranks_is_said_once(tmp_path, monkeypatch):
    """What the launcher prints when every rank rejects the same input: one cause, all its ranks;
    a different cause on another rank keeps its own part. Error files by torch's ErrorHandler."""
    failures = {}
    for rank, msg in ((0, "loss: not a scalar"), (1, "loss: not a scalar"), (2, "other")):
        path = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        try:
            raise ConfigError(msg)
        except ConfigError as e:
            ErrorHandler().record_exception(e)
        failures[rank] = ProcessFailure(rank, 100 + rank, 2, str(path))
    assert describe_failures(failures, 0, "n1") == (
        "worker ranks 0, 1 (pids 100, 101) on node n1 failed: ConfigError: loss: not a scalar; "
        "worker rank 2 (pid 102) on node n1 failed: ConfigError: other")
