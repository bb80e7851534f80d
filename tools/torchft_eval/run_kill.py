# Fault drill for torchft on CPU/gloo: lighthouse + 2 replica groups (torchrun, 1 proc each).
# SIGKILL replica group 1 mid-training, watch group 0, restart group 1, check heal + equal params.
# usage: venv/bin/python run_kill.py OUTDIR [group|worker] [heartbeat_timeout_ms]
#   group : SIGKILL torchrun agent + worker of rg1 (whole replica group lost), restart it by hand
#   worker: SIGKILL only rg1's worker; its torchrun (--max-restarts=3) restarts it
import json
import os
import signal
import subprocess
import sys
import time

OUT = sys.argv[1]
MODE = sys.argv[2] if len(sys.argv) > 2 else "group"
HB = sys.argv[3] if len(sys.argv) > 3 else "5000"
STEPS, KILL_AT, DOWN_S = int(os.environ.get("STEPS", 300)), int(os.environ.get("KILL_AT", 60)), 8.0
VENV = os.environ.get("VENV", os.path.join(os.path.dirname(os.path.abspath(__file__)), "venv", "bin"))
os.makedirs(OUT, exist_ok=True)
env = dict(os.environ, OMP_NUM_THREADS="1", PATH=VENV + ":" + os.environ["PATH"],
           TORCHFT_LIGHTHOUSE="http://127.0.0.1:29510", STEPS=str(STEPS), STEP_SLEEP=os.environ.get("STEP_SLEEP", "0.1"))
ev = {"mode": MODE, "heartbeat_timeout_ms": int(HB)}


def now():
    return time.time()


def lines(rg):
    try:
        with open(f"{OUT}/rg{rg}.jsonl") as f:
            return [json.loads(l) for l in f if l.strip()]
    except FileNotFoundError:
        return []


def last_step(rg):
    s = [r for r in lines(rg) if r["event"] == "step"]
    return s[-1]["step"] if s else -1


def start_rg(rg, tag=""):
    e = dict(env, REPLICA_GROUP_ID=str(rg), LOG=f"{OUT}/rg{rg}.jsonl")
    cmd = ["torchrun", "--nproc_per_node=1", f"--master_port={29600 + rg}",
           f"--max-restarts={0 if MODE == 'group' else 3}", os.environ.get("SCRIPT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_ft.py"))]
    return subprocess.Popen(cmd, env=e, stdout=open(f"{OUT}/rg{rg}{tag}.out", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


lh = subprocess.Popen([f"{VENV}/torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100",
                       "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", HB, "--bind", "127.0.0.1:29510"],
                      env=env, stdout=open(f"{OUT}/lighthouse.log", "w"), stderr=subprocess.STDOUT)
time.sleep(1)
p0, p1 = start_rg(0), start_rg(1)
deadline = now() + 120
while min(last_step(0), last_step(1)) < KILL_AT and now() < deadline:
    time.sleep(0.05)
worker_pid = [r for r in lines(1) if r["event"] == "start"][-1]["pid"]
ev["step_at_kill"] = {"rg0": last_step(0), "rg1": last_step(1)}
ev["t_kill"] = now()
if MODE == "group":
    # torchrun starts its workers with start_new_session=True, so killpg(agent) alone leaves the
    # worker running as an orphan (observed: it kept training). Kill the worker by pid too.
    os.kill(worker_pid, signal.SIGKILL)
    os.killpg(p1.pid, signal.SIGKILL)  # torchrun agent
    p1.wait()
    time.sleep(DOWN_S)
    ev["step_rg0_before_restart"] = last_step(0)
    ev["t_restart"] = now()
    p1 = start_rg(1, "_restart")
elif MODE == "midcoll":
    # rg1 stalls before backward at PAUSE_STEP (train_ft.py hook) while rg0 waits inside allreduce
    while not any(r["event"] == "paused" for r in lines(1)):
        time.sleep(0.02)
    time.sleep(0.5)
    ev["t_kill"] = now()
    ev["step_at_kill"] = {"rg0": last_step(0), "rg1": last_step(1)}
    os.kill(worker_pid, signal.SIGKILL)
else:
    os.kill(worker_pid, signal.SIGKILL)  # torchrun notices and restarts the worker
ev["killed_worker_pid"] = worker_pid
rcs = {"rg0": p0.wait(timeout=300), "rg1": p1.wait(timeout=300)}
lh.send_signal(signal.SIGTERM)
lh.wait()
ev["exit_codes"] = rcs

# analysis
L0, L1 = lines(0), lines(1)
tk = ev["t_kill"]
s0 = [r for r in L0 if r["event"] == "step"]
after = [r for r in s0 if r["t"] > tk]
first_commit = next(r for r in after if r["step"] > r["step_before"]) if MODE == "midcoll" else next(r for r in after if r["step"] > r["step_before"] and r["t"] - r["dt"] > tk)
ev["survivor_all_steps_first_3s_after_kill"] = [
    {k: r[k] for k in ("t", "dt", "step_before", "step", "participants")} | {"t_rel": round(r["t"] - tk, 3)}
    for r in after if r["t"] < tk + 3 or r is after[0]]
gaps = [b["t"] - a["t"] for a, b in zip([s for s in s0 if s["t"] <= tk][-1:] + after, after)]
ev["survivor_max_gap_between_logged_steps_after_kill_s"] = round(max(gaps), 3)
one = next((r for r in after if r["participants"] == 1 and r["step"] > r["step_before"]), None)
ev["survivor_first_commit_with_1_participant_s_after_kill"] = round(one["t"] - tk, 3) if one else None
ev["survivor_first_commit_after_kill_s"] = round(first_commit["t"] - tk, 3)
ev["survivor_first_commit_after_kill"] = first_commit
ev["survivor_uncommitted_steps_after_kill"] = sum(1 for r in after if r["step"] == r["step_before"] and r["t"] < first_commit["t"] + 1e-9)
ev["survivor_steps_with_1_participant"] = sum(1 for r in s0 if r["participants"] == 1 and r["t"] > tk)
starts1 = [r for r in L1 if r["event"] == "start"]
restart = starts1[-1]
ev["rg1_restarted_process_start_t"] = restart["t"]
s1_new = [r for r in L1 if r["event"] == "step" and r["t"] > restart["t"]]
ev["rg1_first_step_after_restart"] = s1_new[0]
base = ev.get("t_restart", tk)
ev["heal_from_launch_s"] = round(s1_new[0]["t"] - base, 3)
ev["heal_from_process_ready_s"] = round(s1_new[0]["t"] - restart["t"], 3)
back2 = next((r for r in s0 if r["t"] > (one["t"] if one else tk) and r["participants"] == 2 and r["step"] > r["step_before"]), None)
ev["survivor_back_to_2_participants_s_after_kill"] = round(back2["t"] - tk, 3) if back2 else None
# do both groups hold identical params at every step both logged after the heal?
h0 = {r["step"]: r["phash"] for r in s0 if r.get("phash")}
h1 = {r["step"]: r["phash"] for r in s1_new if r.get("phash")}
common = sorted(set(h0) & set(h1))
ev["steps_compared_after_heal"] = len(common)
ev["hash_mismatches_after_heal"] = [s for s in common if h0[s] != h1[s]]
d0 = [r for r in L0 if r["event"] == "done"][-1]
d1 = [r for r in L1 if r["event"] == "done"][-1]
ev["final"] = {"rg0": d0, "rg1": d1}
import torch

a, b = torch.load(f"{OUT}/rg0.final.pt"), torch.load(f"{OUT}/rg1.final.pt")
ev["final_params_bitwise_equal"] = all(torch.equal(a[k], b[k]) for k in a)
json.dump(ev, open(f"{OUT}/result.json", "w"), indent=1)
print(json.dumps(ev, indent=1))
