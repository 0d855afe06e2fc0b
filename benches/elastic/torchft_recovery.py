"""torchft's fault-tolerant DDP with a replica group killed, on the kungfu
process group (kungfu.torch.torchft) and on torchft's own gloo one, in
the same run: two replica groups of one worker each on loopback
(torchft's lighthouse, torchrun per group, benches/elastic/torchft_worker.py),
group 1 SIGKILLed once it has run KILL_AT steps, started again once group
0 has gone on alone for 5 steps. Per run: the seconds from the kill to
the first step group 0 committed alone, from the restart to the first
step the new group 1 committed with group 0 (it got the state from group
0 over the process group), and whether the two ended with the same
parameters.

    benches/elastic/torchft_recovery.py [--rounds 5] [--json docs/bench/torchft.json]

torchft (PyPI) is installed, where the venv has none, into
target/torchft/site with --no-deps (it must not replace torch) and its
opentelemetry dependencies. torchft's own examples/train_ddp.py does not
run here unchanged (it needs torchvision and torchdata and downloads
CIFAR-10); torchft_worker.py is a small DDP job of its API instead, with
one change of torchft's DDP comm hook that both process groups need (see
there).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches" / "peers"))
from tables import Table, write_json  # noqa: E402

WORKER = ROOT / "benches" / "elastic" / "torchft_worker.py"
SITE = ROOT / "target" / "torchft" / "site"
KILL_AT, STEPS = 60, 240


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def ensure_torchft(env):
    py = sys.executable
    if subprocess.run([py, "-c", "import torchft"], env=env, capture_output=True).returncode:
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--target", str(SITE),
                        "torchft"], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "--target", str(SITE),
                        "opentelemetry-api", "opentelemetry-sdk",
                        "opentelemetry-exporter-otlp-proto-http"], check=True)
    subprocess.run([py, "-c", "import torchft"], env=env, check=True)


def tree(pid):
    """`pid` and its descendants (torchrun's worker is in a session of its
    own)."""
    kids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def lighthouse():
    """The path of torchft's `torchft_lighthouse` script."""
    for d in (Path(sys.executable).parent, SITE / "bin"):
        if (d / "torchft_lighthouse").is_file():
            return str(d / "torchft_lighthouse")
    raise FileNotFoundError("torchft_lighthouse: not in the venv nor in " + str(SITE / "bin"))


def steps_of(out, group):
    rows = []
    for f in out.glob(f"steps-{group}-*.jsonl"):
        rows += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return rows


def group(pg, g, out, env, log):
    torchrun = str(Path(sys.executable).parent / "torchrun")
    e = dict(env, PG=pg, REPLICA_GROUP_ID=str(g), STEPS=str(STEPS), OUT=str(out))
    return subprocess.Popen([torchrun, "--nnodes", "1", "--nproc-per-node", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                             str(WORKER)], env=e, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, stdin=subprocess.DEVNULL)


def one(pg, out, env):
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        f.unlink()
    port = free_port()
    env = dict(env, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}")
    procs = []
    with open(out / "log.txt", "wb") as log:
        try:
            # (its console script: the lighthouse parses the process's
            # arguments after the script's path)
            lh = subprocess.Popen([sys.executable, lighthouse(), "--bind",
                                   f"127.0.0.1:{port}", "--min_replicas", "1",
                                   "--quorum_tick_ms", "100", "--join_timeout_ms", "1000"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
            procs.append(lh)
            time.sleep(1)
            procs += [group(pg, 0, out, env, log), group(pg, 1, out, env, log)]
            deadline = time.time() + 120
            while not any(r.get("step", 0) >= KILL_AT and r.get("n") == 2
                          for r in steps_of(out, 1)):
                if time.time() > deadline:
                    raise RuntimeError("group 1 never reached the kill step with 2 groups")
                time.sleep(0.05)
            killed = time.time()
            for pid in tree(procs[2].pid):  # torchrun and its worker
                os.kill(pid, signal.SIGKILL)
            # group 0 goes on alone for 5 steps, then group 1 starts again
            deadline = time.time() + 60
            while sum(1 for r in steps_of(out, 0)
                      if "step" in r and r["t"] > killed and r["n"] == 1) < 5:
                if time.time() > deadline:
                    raise RuntimeError("group 0 did not go on alone")
                time.sleep(0.05)
            restarted = time.time()
            procs.append(group(pg, 1, out, env, log))
            deadline = time.time() + 180
            while procs[1].poll() is None or procs[3].poll() is None:
                if time.time() > deadline:
                    raise RuntimeError("the groups did not finish")
                time.sleep(0.2)
        finally:
            for p in procs:
                for pid in tree(p.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    g0, g1 = steps_of(out, 0), steps_of(out, 1)
    alone = min(r["t"] for r in g0 if "step" in r and r["t"] > killed and r["n"] == 1)
    healed = min(r["t"] for r in g1 if "step" in r and r["t"] > restarted and r["n"] == 2)
    digests = {r["digest"] for r in g0 + g1 if "digest" in r and r["t"] > killed}
    return {"alone": alone - killed, "healed": healed - restarted,
            "same_params": len(digests) == 1, "finished": len(digests) > 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "torchft.json")
    ap.add_argument("--out", type=Path, default=ROOT / "target" / "bench-torchft")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    ensure_torchft(env)
    runs = {"kungfu": [], "gloo": []}
    for r in range(args.rounds):
        for pg in runs:
            try:
                fig = one(pg, args.out / f"{pg}-{r}", env)
                fig["ok"] = fig["finished"] and fig["same_params"]
            except Exception as e:  # noqa: BLE001  a failed run is kept, with why
                fig = {"ok": False, "why": f"{type(e).__name__}: {e}"}
            fig["round"] = r
            runs[pg].append(fig)
            print(f"round {r} {pg}: {json.dumps(fig)}", flush=True)
    t = Table("torchft", "torchft DDP, 2 replica groups of 1 worker, group 1 SIGKILLed and "
              "started again: seconds from the kill, median [quartiles] of the rounds",
              ["process group", "runs ok", "to group 0's first step alone",
               "from its restart to the restarted group's first step with group 0"],
              ["{}"] * 4,
              command="benches/elastic/torchft_recovery.py " + " ".join(sys.argv[1:]))

    def med(xs):
        xs = sorted(xs)
        if not xs:
            return None
        q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
        return f"{statistics.median(xs):.3f} [{q[0]:.3f}-{q[2]:.3f}]"

    for pg, name in (("kungfu", "kungfu (ProcessGroupKungfu)"), ("gloo", "gloo (torchft's)")):
        ok = [f for f in runs[pg] if f["ok"]]
        t.add(name, f"{len(ok)} of {len(runs[pg])}", med([f["alone"] for f in ok]),
              med([f["healed"] for f in ok]))
    write_json(args.json, [t], runs=runs, kill_at=KILL_AT, steps=STEPS)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
