"""The scheduler recipes (examples/slurm, examples/k8s) rendered with values filled in: the Slurm
script runs under stand-ins for scontrol/srun (no Slurm here) and must start the documented
multi-node command once per node; the Kubernetes manifest must parse and say the same."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

from conftest import ROOT

SBATCH = ROOT / "examples" / "slurm" / "allhands.sbatch"
K8S = ROOT / "examples" / "k8s" / "allhands-job.yaml"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    p = bin_dir / name
    p.write_text("#!/bin/bash\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_slurm_script_starts_one_launcher_per_node(tmp_path):
    assert subprocess.run(["bash", "-n", str(SBATCH)], timeout=60).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    _stub(bin_dir, "scontrol", '[ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\n"\n')
    _stub(bin_dir, "getent", '[ "$2" = "gpu-a17" ] && echo "10.9.0.17 STREAM gpu-a17"\n')
    # srun runs its command once per node, as Slurm would, with that node's id and address.
    _stub(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done\n'
          'for i in $(seq 0 $((SLURM_NNODES - 1))); do\n'
          '  SLURM_NODEID=$i LOCAL_ADDR=10.9.0.$((17 + i)) "$@" || exit 1\ndone\n')
    _stub(bin_dir, "fake-allhands", f'echo "$*" >> {log}\n')
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-a[17-18]",
               SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8", CONFIG="job.toml", RUN_DIR="/shared/r1",
               ALLHANDS=str(bin_dir / "fake-allhands"), ALLHANDS_SECRET="s")
    r = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    calls = log.read_text().splitlines()
    assert calls == [
        f"train job.toml --nnodes 2 --node-rank {i} --nproc 8 --rdzv-endpoint 10.9.0.17:29400 "
        f"--local-addr 10.9.0.{17 + i} --set run.dir=/shared/r1" for i in range(2)]
    # NNODES_MIN: an elastic job that goes on without a lost node (srun must not end the step).
    log.unlink()
    _stub(bin_dir, "srun", 'echo "$1" > ' + str(tmp_path / "srun-flag") + '\n'
          'while [[ "$1" == --* ]]; do shift; done\n'
          'for i in $(seq 0 $((SLURM_NNODES - 1))); do\n'
          '  SLURM_NODEID=$i LOCAL_ADDR=10.9.0.$((17 + i)) "$@" || exit 1\ndone\n')
    r = subprocess.run(["bash", str(SBATCH)], env=dict(env, NNODES_MIN="1"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert all(" --nnodes 1:2 " in c for c in log.read_text().splitlines())
    assert (tmp_path / "srun-flag").read_text().strip() == "--kill-on-bad-exit=0"
    # Without a run directory it stops before srun, saying what to set.
    env.pop("RUN_DIR")
    r = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "RUN_DIR" in r.stderr


# --------------------------------------------------------------------- a strict YAML subset
def _scalar(text: str):
    if text.startswith(("[", '"')):
        return json.loads(text)
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"true": True, "false": False}.get(text, text)


def _block(lines: list[tuple[int, str]], i: int, indent: int):
    """Parse block mappings/sequences at ``indent``; raises on anything outside the subset."""
    seq = lines[i][1].startswith("- ")
    out: list | dict = [] if seq else {}
    while i < len(lines) and lines[i][0] == indent:
        ind, text = lines[i]
        if seq:
            if not text.startswith("- "):
                raise ValueError(f"expected a sequence item: {text!r}")
            # "- key: value" opens a mapping whose keys sit at indent + 2
            lines[i] = (indent + 2, text[2:])
            value, i = _block(lines, i, indent + 2)
            out.append(value)
            continue
        key, sep, rest = text.partition(":")
        if not sep or key in out or " " in key:
            raise ValueError(f"bad or duplicate mapping line: {text!r}")
        rest = rest.strip()
        i += 1
        if rest:
            out[key] = _scalar(rest)
        elif i < len(lines) and lines[i][0] > indent:
            out[key], i = _block(lines, i, lines[i][0])
        else:
            raise ValueError(f"key without value: {key!r}")
    if i < len(lines) and lines[i][0] > indent:
        raise ValueError(f"unexpected indentation: {lines[i][1]!r}")
    return out, i


def parse_manifests(text: str) -> list[dict]:
    docs = []
    for doc in text.split("\n---\n"):
        lines = [(len(l) - len(l.lstrip(" ")), l.strip()) for l in doc.splitlines()
                 if l.strip() and not l.lstrip().startswith("#")]
        value, end = _block(lines, 0, 0)
        assert end == len(lines)
        docs.append(value)
    return docs


VALUES = {"NAME": "job1", "IMAGE": "reg/allhands:1", "NNODES": "2", "NPROC": "8", "GPUS": "8",
          "CONFIG": "/shared/job.toml", "PVC": "runs"}


def render(text: str) -> str:
    """What `envsubst '$NAME $IMAGE ...'` does: only the named ${VAR}s; any other ${...} is an
    error here (it would reach the cluster unfilled)."""
    def sub(m):
        if m.group(1) not in VALUES:
            raise KeyError(f"unknown placeholder ${{{m.group(1)}}}")
        return VALUES[m.group(1)]
    return re.sub(r"\$\{(\w+)\}", sub, text)


def test_kubernetes_manifest_renders_and_parses(tmp_path):
    text = render(K8S.read_text())
    svc, job = parse_manifests(text)
    try:  # cross-check the subset parser where a full YAML parser is at hand
        import yaml

        assert list(yaml.safe_load_all(text)) == [svc, job]
    except ImportError:
        if shutil.which("kubectl"):
            path = tmp_path / "m.yaml"
            path.write_text(text)
            r = subprocess.run(["kubectl", "label", "--local", "-f", str(path), "-o", "json", "x=y"],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            items, pos, dec = [], 0, json.JSONDecoder()  # one JSON document per manifest
            while r.stdout[pos:].strip():
                obj, pos = dec.raw_decode(r.stdout, pos + len(r.stdout[pos:]) - len(r.stdout[pos:].lstrip()))
                items.append(obj)
            assert [i["kind"] for i in items] == ["Service", "Job"]
            assert items[1]["spec"]["completions"] == 2
    assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"job-name": "job1"}
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == "job1" and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["image"] == "reg/allhands:1"
    assert c["args"] == ["exec allhands train /shared/job.toml --nnodes 2 --node-rank "
                         "$JOB_COMPLETION_INDEX --nproc 8 --rdzv-endpoint job1-0.job1:29400 "
                         "--local-addr $POD_IP --set run.dir=/shared/runs/job1"]
    env = {e["name"]: e["valueFrom"] for e in c["env"]}
    assert env["ALLHANDS_SECRET"] == {"secretKeyRef": {"name": "job1-secret", "key": "secret"}}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {v["name"] for v in pod["volumes"]} == {m["name"] for m in c["volumeMounts"]}


def test_slurm_script_can_run_the_rendezvous_store_on_the_batch_host(tmp_path):
    """RDZV_STORE=batch: the batch host serves only the store (on its own address), the other
    nodes train as --rdzv-store external clients with node ranks 0..N-2, and the store is stopped
    when the script ends."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log, flags = tmp_path / "calls", tmp_path / "srun-flags"
    _stub(bin_dir, "scontrol", '[ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\ngpu-a19\\n"\n')
    _stub(bin_dir, "getent", '[ "$2" = "gpu-a17" ] && echo "10.9.0.17 STREAM gpu-a17"\n')
    # As Slurm: --nodes=K --relative=1 runs K tasks on the nodes after the first.
    _stub(bin_dir, "srun", f'n=$SLURM_NNODES; rel=0\nwhile [[ "$1" == --* ]]; do echo "$1" >> {flags}\n'
          '  case "$1" in --nodes=*) n=${1#--nodes=};; --relative=*) rel=${1#--relative=};; esac; shift\ndone\n'
          'for i in $(seq 0 $((n - 1))); do\n'
          '  SLURM_PROCID=$i SLURM_NODEID=$((i + rel)) LOCAL_ADDR=10.9.0.$((17 + rel + i)) "$@" || exit 1\ndone\n')
    _stub(bin_dir, "fake-allhands", f'echo "$*" >> {log}\n'
          f'[ "$1" = rendezvous-store ] && echo $$ > {tmp_path / "store.pid"} && exec sleep 60\ntrue\n')
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-a[17-19]",
               SLURM_NNODES="3", SLURM_GPUS_ON_NODE="8", CONFIG="job.toml", RUN_DIR="/shared/r1",
               ALLHANDS=str(bin_dir / "fake-allhands"), ALLHANDS_SECRET="s", RDZV_STORE="batch",
               NNODES_MIN="1")
    r = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert log.read_text().splitlines() == ["rendezvous-store --bind 10.9.0.17 --port 29400"] + [
        f"train job.toml --nnodes 1:2 --node-rank {i} --nproc 8 --rdzv-endpoint 10.9.0.17:29400 "
        f"--rdzv-store external --local-addr 10.9.0.{18 + i} --set run.dir=/shared/r1" for i in range(2)]
    assert flags.read_text().split() == ["--kill-on-bad-exit=0", "--ntasks-per-node=1", "--nodes=2",
                                         "--relative=1"]
    pid = int((tmp_path / "store.pid").read_text())
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # killed by the EXIT trap
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    # One node cannot both serve the store and train.
    r = subprocess.run(["bash", str(SBATCH)], env=dict(env, SLURM_NNODES="1", SLURM_JOB_NODELIST="gpu-a17"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "RDZV_STORE=batch needs --nodes=2" in r.stderr


K8S_STORE = ROOT / "examples" / "k8s" / "allhands-rendezvous-store.yaml"


def test_kubernetes_store_manifest_renders_parses_and_matches_the_job(tmp_path):
    text = render(K8S_STORE.read_text())
    svc, dep = parse_manifests(text)
    try:
        import yaml

        assert list(yaml.safe_load_all(text)) == [svc, dep]
    except ImportError:
        pass
    assert svc["kind"] == "Service" and svc["metadata"]["name"] == "job1-rdzv"
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == 1
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] == labels == dep["spec"]["selector"]["matchLabels"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "reg/allhands:1"
    assert c["args"] == ["exec allhands rendezvous-store --bind $POD_IP --port 29400"]
    assert svc["spec"]["ports"][0]["targetPort"] == c["ports"][0]["containerPort"] == 29400
    # The job manifest says how its pods reach this store, by the Service's name.
    job_text = render(K8S.read_text())
    assert f"--rdzv-store external --rdzv-endpoint {svc['metadata']['name']}:29400" in job_text
