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
from pathlib import Path

from conftest import ROOT

SBATCH = ROOT / "examples" / "slurm" / "allhands.sbatch"
K8S = ROOT / "examples" / "k8s" / "allhands-job.yaml"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    p = bin_dir / name
    p.write_text("#!/bin/bash\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_slurm_script_starts_one_launcher_per_node(tmp_path):
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
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
