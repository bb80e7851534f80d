# Prints one table row per drill from logs/*/result.json (written by run_kill.py).
import glob, json, os

print("| run | kill | heartbeat ms | survivor: kill -> next committed step (s) | survivor died? | killed group: (re)launch -> process ready (s) | ready -> first committed step after heal (s) | kill -> 2 participants again (s) | post-heal steps with equal params | final params bitwise equal |")
print("|---|---|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob("logs/*/result.json")):
    if "orphan" in f:  # that drill did not kill the worker (see REPORT.md); its numbers mean nothing
        continue
    d = os.path.dirname(f); r = json.load(open(f))
    L0 = [json.loads(l) for l in open(d + "/rg0.jsonl")]
    L1 = [json.loads(l) for l in open(d + "/rg1.jsonl")]
    died = sum(1 for x in L0 if x["event"] == "start") > 1
    st1 = [x for x in L1 if x["event"] == "start"][-1]
    base = r.get("t_restart", r["t_kill"])
    c1 = next(x for x in L1 if x["event"] == "step" and x["t"] > st1["t"] and x["step"] > x["step_before"])
    heal = f'{c1["t"] - st1["t"]:.2f} (step {c1["step_before"]}->{c1["step"]})'
    eq = f'{r["steps_compared_after_heal"] - len(r["hash_mismatches_after_heal"])}/{r["steps_compared_after_heal"]}'
    print(f'| {os.path.basename(d)} | {r["mode"]} | {r["heartbeat_timeout_ms"]} | {r["survivor_first_commit_after_kill_s"]:.2f} | {"YES (restarted by torchrun)" if died else "no"} | {st1["t"] - base:.2f} | {heal} | {r["survivor_back_to_2_participants_s_after_kill"]} | {eq} | {r["final_params_bitwise_equal"]} |')
