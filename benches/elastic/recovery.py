"""The recovery benchmark: how long a DDP job of a 10 MB model on 4 workers
takes from a SIGKILL of one worker to its first completed step after it,
on kungfu (`kungfu.torch.elastic`: the same processes go on) beside what
users have on the same machine in the same run: torchrun restarting every
worker from a checkpoint file (`--max-restarts`, c10d rendezvous, gloo),
and gloo with torch's own reconfigure (the survivors meet at a store and
call `dist._reconfigure`). Also a grow from 4 to 5 workers on kungfu, the
state sent from live peers. See worker.py for what each way does.

    benches/elastic/recovery.py [--rounds 5] [--modes kungfu,gloo,torchrun,grow] [--out DIR]

The ways alternate within each round. Every run's events are kept
(OUT/<mode>-<round>/), every run's figures in OUT/recovery.json (default
docs/bench/recovery.json) with the tables of docs/pytorch.md, medians and
quartiles over the rounds. Goals (issue 48, fixed before any run): kill to
first step <= 2.5 s, of which <= 1 s after detection; the grow's state at
>= 0.5 of the transport's bandwidth (a broadcast of as many bytes between
the same workers, timed after it), no healthy worker waiting more than one
step (its commit that took the joiner in, against its median step).
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches" / "peers"))
from tables import Table, write_json  # noqa: E402

WORKER = ROOT / "benches" / "elastic" / "worker.py"
NP, STEPS, KILL_STEP, VICTIM = 4, 30, 12, 1
TIMEOUT = 240


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run(cmd, out, env=None):
    """Runs `cmd` in its own process group, bounded; returns its exit status."""
    with open(out / "log.txt", "wb") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, stdin=subprocess.DEVNULL)
        try:
            return p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return None
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def launch(mode, out):
    py = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = [str(WORKER), mode, str(out), "--kill-step", str(KILL_STEP), "--victim",
            str(VICTIM), "--steps", str(STEPS), "--workers", str(NP)]
    kungfu_run = str(ROOT / "target" / "release" / "kungfu-run")
    if mode == "kungfu":
        return run([kungfu_run, "-np", str(NP), "--on-failure", "shrink", "--timeout",
                    f"{TIMEOUT}s", py, *args], out, env)
    if mode == "grow":
        return run([kungfu_run, "-w", "-np", str(NP), "--timeout", f"{TIMEOUT}s", py, *args],
                   out, env)
    if mode == "torchrun":
        torchrun = str(Path(py).parent / "torchrun")
        return run([torchrun, "--nnodes", "1", "--nproc-per-node", str(NP), "--max-restarts",
                    "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{free_port()}", "--monitor-interval", "0.1", *args], out, env)
    # gloo: the benchmark serves the store the survivors meet at
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    args += ["--store", f"127.0.0.1:{store.port}"]
    procs = []
    with open(out / "log.txt", "wb") as log:
        for r in range(NP):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(NP))
            procs.append(subprocess.Popen([py, *args], stdout=log, stderr=subprocess.STDOUT,
                                          env=e, start_new_session=True,
                                          stdin=subprocess.DEVNULL))
        deadline = time.time() + TIMEOUT
        rc = 0
        for p in procs:
            try:
                code = p.wait(timeout=max(1, deadline - time.time()))
                if code not in (0, -signal.SIGKILL):
                    rc = code
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return rc


def events(out):
    evs = []
    for f in out.glob("events-*.jsonl"):
        evs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(evs, key=lambda e: e["t"])


def recovery_figures(mode, out):
    """Seconds from the kill to detection (the survivors' failed op) and to
    the first step every survivor completed after it."""
    evs = events(out)
    kill = json.loads((out / "killed.json").read_text())
    k, victim = kill["at"], kill["pid"]
    if mode == "torchrun":
        # the restarted workers (other pids than the first ones)
        first = {e["pid"] for e in evs if e["ev"] == "start" and e.get("restart") == 0}
        new = {e["pid"] for e in evs if e["ev"] == "start" and e.get("restart", 0) > 0}
        firsts = [min(e["t"] for e in evs if e["pid"] == p and e["ev"] == "step") for p in new]
        assert len(new) == NP and not (new & first), (first, new)
        return {"detect": None, "first_step": max(firsts) - k, "after_detect": None}
    rec = [e for e in evs if e["ev"] == "recovered"]
    survivors = {e["pid"] for e in rec}
    assert len(survivors) == NP - 1 and victim not in survivors, (survivors, victim)
    detect = max(e["failed_at"] for e in rec) - k
    firsts = []
    for e in rec:
        firsts.append(min(s["t"] for s in evs if s["pid"] == e["pid"] and s["ev"] == "step"
                          and s["t"] > e["recovered_at"]))
    first = max(firsts) - k
    return {"detect": detect, "first_step": first, "after_detect": first - detect}


def grow_figures(out):
    evs = events(out)
    changed = [e for e in evs if e["ev"] == "changed"]
    healthy = {e["pid"] for e in evs if e["ev"] == "start" and not e["joined"]}
    joined = {e["pid"] for e in evs if e["ev"] == "start" and e["joined"]}
    assert len(joined) == 1 and {e["pid"] for e in changed} == healthy, (changed, healthy)
    steps = {}
    for p in healthy:
        ts = [e["t"] for e in evs if e["pid"] == p and e["ev"] == "step"]
        steps[p] = statistics.median(b - a for a, b in zip(ts, ts[1:]))
    pause = max((e["t"] - e["began"]) / steps[e["pid"]] for e in changed)
    sync = max(changed, key=lambda e: e["seconds"])
    bcast = [e for e in evs if e["ev"] == "broadcast"]
    ref = statistics.median(e["bytes"] / e["seconds"] for e in bcast)
    rate = sync["bytes"] / sync["seconds"]
    return {"pause_steps": pause, "state_mb": sync["bytes"] / 1e6,
            "state_gbps": rate / 1e9, "bcast_gbps": ref / 1e9, "ratio": rate / ref,
            "commit_s": max(e["t"] - e["began"] for e in changed)}


def quartiles(xs):
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modes", default="kungfu,gloo,torchrun,grow")
    p.add_argument("--out", type=Path, default=ROOT / "target" / "bench-recovery")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "recovery.json")
    args = p.parse_args()
    modes = args.modes.split(",")
    runs = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            out = args.out / f"{mode}-{r}"
            if out.exists():
                for f in out.iterdir():
                    f.unlink()
            out.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            rc = launch(mode, out)
            try:
                fig = grow_figures(out) if mode == "grow" else recovery_figures(mode, out)
                fig["ok"] = True
            except Exception as e:  # noqa: BLE001  a failed run is kept, with why
                fig = {"ok": False, "why": f"{type(e).__name__}: {e}"}
            fig.update(round=r, rc=rc, wall=time.time() - t0)
            runs[mode].append(fig)
            print(f"round {r} {mode}: {json.dumps(fig)}", flush=True)
    cmd = "benches/elastic/recovery.py " + " ".join(sys.argv[1:])
    rec = Table("recovery", f"DDP, 10 MB model, {NP} workers, one SIGKILLed at step {KILL_STEP}: "
                "seconds from the kill, median [quartiles] of the rounds",
                ["way", "runs ok", "to detection", "to first step", "first step after detection"],
                ["{}", "{}", "{}", "{}", "{}"], command=cmd)

    def med(xs):
        if not xs:
            return None
        lo, m, hi = quartiles(xs)
        return f"{m:.3f} [{lo:.3f}-{hi:.3f}]"

    names = {"kungfu": "kungfu (same processes)", "gloo": "gloo + torch reconfigure",
             "torchrun": "torchrun restart (gloo)"}
    for m in [m for m in ("kungfu", "gloo", "torchrun") if m in runs]:
        ok = [f for f in runs[m] if f["ok"]]
        rec.add(names[m], f"{len(ok)} of {len(runs[m])}",
                med([f["detect"] for f in ok if f["detect"] is not None]),
                med([f["first_step"] for f in ok]),
                med([f["after_detect"] for f in ok if f["after_detect"] is not None]))
    tables = [rec]
    if "grow" in runs:
        ok = [f for f in runs["grow"] if f["ok"]]
        grow = Table("grow", f"kungfu, {NP} -> {NP + 1} workers, the state from live peers: "
                     "median [quartiles] of the rounds", ["runs ok", "state (MB)",
                     "state GB/s", "broadcast GB/s", "state / broadcast",
                     "longest pause (steps)"], ["{}"] * 6, command=cmd)
        grow.add(f"{len(ok)} of {len(runs['grow'])}", med([f["state_mb"] for f in ok]),
                 med([f["state_gbps"] for f in ok]), med([f["bcast_gbps"] for f in ok]),
                 med([f["ratio"] for f in ok]), med([f["pause_steps"] for f in ok]))
        tables.append(grow)
    goals = {}
    kf = [f for f in runs.get("kungfu", []) if f["ok"]]
    if kf:
        first = statistics.median(f["first_step"] for f in kf)
        after = statistics.median(f["after_detect"] for f in kf)
        goals["kill to first step <= 2.5 s"] = ("met" if first <= 2.5 else "missed", first)
        goals["after detection <= 1 s"] = ("met" if after <= 1.0 else "missed", after)
    gr = [f for f in runs.get("grow", []) if f["ok"]]
    if gr:
        ratio = statistics.median(f["ratio"] for f in gr)
        pause = statistics.median(f["pause_steps"] for f in gr)
        goals["state at >= 0.5 of the broadcast's bandwidth"] = (
            "met" if ratio >= 0.5 else "missed", ratio)
        goals["no healthy worker waits > 1 step"] = ("met" if pause <= 1.0 else "missed", pause)
    for g, (verdict, v) in goals.items():
        print(f"goal: {g}: {verdict} ({v:.3f})")
    write_json(args.json, tables, runs=runs, goals={g: list(v) for g, v in goals.items()},
               np=NP, steps=STEPS, kill_step=KILL_STEP, model_mb=10.5)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
