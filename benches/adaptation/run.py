#!/usr/bin/env python3
"""The adaptation experiments: KungFu's claims, reproduced with real
PyTorch on this machine (benches/adaptation/train.py under kungfu-run).

    benches/adaptation/run.py [--only batch sync monitor interference scale]
                              [--rounds 3] [--out docs/bench/adaptation] [--short]

1. batch: the batch grows with the gradient noise scale (policy `gns`)
   against the fixed batches it starts and ends with: wall time to the
   target accuracy.
2. interference: 4 workers over TCP; one worker's egress (rank 3, a leaf
   of the trees) is shaped mid-run (KUNGFU_FAULTS rate_mb with
   rate_after_ms); a policy reading peer_rates switches from the ring
   (where every rank sends 2 (n-1)/n of the buffer) to a tree (where a
   leaf sends it once). Steps from the slowdown to the agreed switch, and
   the throughput after it against the static strategies under the same
   interference.
3. monitor: DDP step time with the noise-scale comm hook against without
   (alternating rounds).
4. sync: S-SGD, SMA, pair averaging and Adaptive SGD: accuracy against time.
5. scale: under `kungfu-run -w -np 1`, a policy grows the cluster 1 -> 2
   -> 4 while each added worker adds enough throughput, else goes back.

Each experiment writes OUT/<name>.json (its tables, through
benches/peers/tables.py, and its curves) and OUT/<name>.svg. `--short`
runs one small round of each, into a scratch directory unless --out is
given: what CI runs so that the scripts keep working (the policies' runs,
not every static one).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "benches" / "peers"))
sys.path.insert(0, str(HERE))

import plot  # noqa: E402
import tables  # noqa: E402

TRAIN = HERE / "train.py"


def job(a, np, args, launcher=(), env=None, timeout=300):
    """Runs train.py under kungfu-run; returns rank 0's JSON lines."""
    fd, out = tempfile.mkstemp(prefix="kungfu-adapt-", suffix=".jsonl")
    os.close(fd)
    cmd = [a.kungfu_run, "-np", str(np), *launcher, "--timeout", f"{timeout}s",
           a.python, str(TRAIN), *args, "--out", out]
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    p = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        log, _ = p.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        log, _ = p.communicate()
        raise SystemExit(f"timed out: {' '.join(cmd)}\n{log[-3000:]}")
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{log[-6000:]}")
    with open(out) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    os.unlink(out)
    if not lines:
        raise SystemExit(f"no results: {' '.join(cmd)}\n{log[-3000:]}")
    if os.path.exists(out + ".steps"):  # rank 0's step times (train.py)
        with open(out + ".steps") as f:
            lines[-1]["timing"] = json.load(f)
        os.unlink(out + ".steps")
    return lines


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def time_to(lines, target):
    return next((x["t"] for x in lines if x["acc"] >= target), None)


def median_run(runs, key):
    """The run whose `key` is the median (None last)."""
    order = sorted(runs, key=lambda r: (key(r) is None, key(r) or 0))
    return order[(len(order) - 1) // 2]


def save(a, name, tabs, svg, **data):
    os.makedirs(a.out, exist_ok=True)
    tables.write_json(os.path.join(a.out, f"{name}.json"), tabs, **data)
    with open(os.path.join(a.out, f"{name}.svg"), "w") as f:
        f.write(svg)
    for t in tabs:
        print(tables.render(t.to_json()), "\n", flush=True)


def exp_batch(a):
    """Experiment 1: time to the target accuracy."""
    limit = 4 if a.short else 30
    common = ["--target", str(a.batch_target), "--time-limit", str(limit), "--epochs", "100",
              "--eval-every", "2048"]
    configs = [
        ("fixed 16", ["--batch", "16", "--lr", "0.02"]),
        # the learning rate of the adaptive run at 128: the square-root rule
        ("fixed 128", ["--batch", "128", "--lr", f"{0.02 * 8 ** 0.5:.4f}"]),
        ("adaptive 16->128", ["--batch", "16", "--lr", "0.02", "--policy", "gns",
                              "--max-batch", "128", "--every", "10"]),
    ]
    if a.short:  # the policy's path; the fixed runs differ only in their arguments
        configs = configs[-1:]
    runs = {c: [] for c, _ in configs}
    for _ in range(a.rounds):
        for c, args in configs:
            runs[c].append(job(a, 2, common + args, timeout=limit + 120))
    t = tables.Table("batch", f"time to {a.batch_target:.0%} held-out accuracy, 2 workers "
                     f"(medians of {a.rounds} runs)",
                     ["run", "time to target (s)", "runs reaching it", "final batch per worker"],
                     ["{}", "{:.1f}", "{}", "{}"], command="benches/adaptation/run.py --only batch")
    series = []
    for k, (c, _) in enumerate(configs):
        ts = [time_to(r, a.batch_target) for r in runs[c]]
        reached = sum(x is not None for x in ts)
        t.add(c, median(ts), f"{reached}/{len(ts)}", median([r[-1]["batch"] for r in runs[c]]))
        best = median_run(runs[c], lambda r: time_to(r, a.batch_target))
        series.append((c, plot.COLOURS[k], [(x["t"], x["acc"]) for x in best]))
    svg = plot.svg("Adaptive batch size (gradient noise scale), 2 workers", "seconds",
                   "held-out accuracy", series)
    save(a, "batch", [t], svg, curves={c: s for c, _, s in series})


def exp_sync(a):
    """Experiment 4: the synchronisation strategies, accuracy against time."""
    limit = 3 if a.short else 30
    # (short: the two python/tests/test_optimizers.py does not train)
    kinds = ["pair", "adasgd"] if a.short else ["ssgd", "sma", "pair", "adasgd"]
    runs = {k: [] for k in kinds}
    for _ in range(a.rounds):
        for k in kinds:
            runs[k].append(job(a, 2, ["--sync", k, "--batch", "32", "--lr", "0.02",
                                      "--time-limit", str(limit), "--epochs", "100",
                                      "--target", str(a.target), "--eval-every", "2048"],
                               timeout=limit + 120))
    t = tables.Table("sync", f"synchronisation strategies, 2 workers, batch 32 per worker "
                     f"(medians of {a.rounds} runs)",
                     ["sync", f"time to {a.target:.0%} (s)", "accuracy at the end",
                      "samples/s"], ["{}", "{:.1f}", "{:.3f}", "{:.0f}"],
                     command="benches/adaptation/run.py --only sync")
    series = []
    for i, k in enumerate(kinds):
        t.add(k, median([time_to(r, a.target) for r in runs[k]]),
              median([r[-1]["acc"] for r in runs[k]]),
              median([median([x["throughput"] for x in r[1:]] or [None]) for r in runs[k]]))
        best = median_run(runs[k], lambda r: time_to(r, a.target))
        series.append((k, plot.COLOURS[i], [(x["t"], x["acc"]) for x in best]))
    svg = plot.svg("Synchronisation strategies, 2 workers", "seconds", "held-out accuracy",
                   series)
    save(a, "sync", [t], svg, curves={k: s for k, _, s in series})


def exp_monitor(a):
    """Experiment 3: the monitors' cost in DDP, alternating rounds, on the
    experiments' CNN and on one of 4 times its channels."""
    steps = 20 if a.short else 400
    widths = [1] if a.short else [1, 4]
    res = {(w, mon): [] for w in widths for mon in (False, True)}
    params = {}
    for _ in range(max(a.rounds, 1) * (1 if a.short else 2)):
        for w in widths:
            for mon in (False, True):
                args = ["--ddp", "--batch", "32", "--steps", str(steps), "--width", str(w)]
                line = job(a, 2, args + (["--monitor"] if mon else []), timeout=300)[-1]
                res[(w, mon)].append(line["median_step_s"])
                params[w] = line["params"]
    runs = len(res[(1, True)])
    t = tables.Table("monitor", f"DDP step time without and with the noise-scale hook "
                     f"(kungfu.torch.hooks.noise_scale_hook), 2 workers, batch 32, {steps} steps "
                     f"per run, medians of {runs} alternating runs",
                     ["model", "parameters", "without (ms)", "with the monitors (ms)", "ratio"],
                     ["{}", "{}", "{:.3f}", "{:.3f}", "{:.3f}"],
                     command="benches/adaptation/run.py --only monitor")
    series = []
    for i, w in enumerate(widths):
        off, on = median(res[(w, False)]), median(res[(w, True)])
        t.add("CNN" if w == 1 else f"CNN, {w}x channels", params[w], off * 1e3, on * 1e3, on / off)
        series += [(f"width {w}, without", plot.COLOURS[2 * i], list(enumerate(sorted(res[(w, False)])))),
                   (f"width {w}, with", plot.COLOURS[2 * i + 1], list(enumerate(sorted(res[(w, True)]))))]
    svg = plot.svg("DDP step time (sorted runs)", "run", "median step time (s)", series)
    save(a, "monitor", [t], svg, runs={f"{w} {'on' if m else 'off'}": v for (w, m), v in res.items()})


def exp_interference(a):
    """Experiment 2: a strategy switch when one link slows down."""
    limit = 8 if a.short else 40
    slow_at = 3 if a.short else 15
    # TCP (kungfu-run's --transport: it sets KUNGFU_TRANSPORT for the
    # workers) and the op machine, whose per-peer counters feed peer_rates
    env = {"KUNGFU_FAST_MAX_BYTES": "0"}
    common = ["--batch", "32", "--lr", "0.02", "--time-limit", str(limit), "--epochs", "100",
              "--eval-every", "1024", "--slow-rank", "3", "--slow-after-s", str(slow_at),
              "--slow-mb", str(a.slow_mb)]
    configs = [("static ring", ["--strategy", "ring"]),
               ("static binary_tree", ["--strategy", "binary_tree"]),
               ("static star", ["--strategy", "star"]),
               ("adaptive (ring, then switch)",
                ["--strategy", "ring", "--policy", "peer-rates", "--switch-to", a.switch_to])]
    if a.short:  # the policy's path
        configs = configs[-1:]
    runs = {c: [] for c, _ in configs}
    for _ in range(a.rounds):
        for c, args in configs:
            runs[c].append(job(a, 4, common + args, launcher=["--transport", "tcp"], env=env,
                               timeout=limit + 120))

    def after(r, t0):
        xs = [x["throughput"] for x in r if x["t"] > t0]
        return median(xs)

    t = tables.Table("interference", f"4 workers over TCP; rank 3's egress shaped to "
                     f"{a.slow_mb:g} MB/s from {slow_at} s (medians of {a.rounds} runs)",
                     ["run", "samples/s before", "samples/s after the slowdown",
                      "switch agreed at step", "steps after the slowdown"],
                     ["{}", "{:.0f}", "{:.0f}", "{}", "{}"],
                     command="benches/adaptation/run.py --only interference")
    series = []
    for i, (c, _) in enumerate(configs):
        rs = runs[c]
        switch = [next((s for s, kind, _ in r[-1]["history"] if kind == "set_strategy"), None)
                  for r in rs]
        # the first step to end after the slowdown began (the wrapper's
        # clock starts at init, before train.py's t0)
        slow_step = [next((k for k, t in r[-1]["timing"]["steps"]
                           if t >= slow_at + r[-1]["timing"]["init_at"]), None) for r in rs]
        lag = [s - w if s is not None and w is not None else None
               for s, w in zip(switch, slow_step)]
        t.add(c, median([median([x["throughput"] for x in r[1:] if x["t"] < slow_at] or [None])
                         for r in rs]),
              median([after(r, slow_at + (limit - slow_at) / 3) for r in rs]),
              median(switch), median(lag))
        best = rs[len(rs) // 2]
        series.append((c, plot.COLOURS[i], [(x["t"], x["throughput"]) for x in best[1:]]))
    svg = plot.svg("Throughput under interference, 4 workers", "seconds", "samples/s", series,
                   marks=[(slow_at, "slowdown")])
    save(a, "interference", [t], svg, curves={c: s for c, _, s in series})


def exp_scale(a):
    """Experiment 5: an elastic scaling policy."""
    limit = 12 if a.short else 60
    rs = []
    for _ in range(a.rounds):
        rs.append(job(a, 1, ["--batch", "64", "--lr", "0.02", "--policy", "scale",
                             "--every", "3" if a.short else "30", "--min-gain",
                             str(a.min_gain), "--time-limit", str(limit), "--epochs", "1000",
                             "--eval-steps", "5"], launcher=["-w"], timeout=limit + 120))
    t = tables.Table("scale", f"elastic scaling from 1 worker (gain threshold {a.min_gain:g} "
                     f"per added worker; {a.rounds} runs)",
                     ["run", "sizes visited", "final size", "resizes (s)"],
                     ["{}", "{}", "{}", "{}"], command="benches/adaptation/run.py --only scale")
    series = []
    for i, r in enumerate(rs):
        sizes = []
        for x in r:
            if not sizes or sizes[-1] != x["size"]:
                sizes.append(x["size"])
        res = r[-1]["resizes"]
        t.add(i + 1, " -> ".join(map(str, sizes)), r[-1]["size"],
              ", ".join(f"{b}->{c}: {s:.2f}" for _, b, c, s in res))
        series.append((f"run {i + 1}", plot.COLOURS[i], [(x["t"], x["throughput"]) for x in r[1:]]))
    svg = plot.svg("Elastic scaling: throughput as the policy resizes", "seconds",
                   "samples/s", series)
    save(a, "scale", [t], svg, curves={c: s for c, _, s in series})


EXPERIMENTS = {"batch": exp_batch, "interference": exp_interference, "monitor": exp_monitor,
               "sync": exp_sync, "scale": exp_scale}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), default=list(EXPERIMENTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--short", action="store_true")
    p.add_argument("--target", type=float, default=0.87, help="sync: the accuracy timed to")
    p.add_argument("--batch-target", type=float, default=0.89,
                   help="batch: the accuracy timed to (near the model's plateau, about 0.90, "
                        "where the batch size matters)")
    p.add_argument("--slow-mb", type=float, default=1.0)
    p.add_argument("--switch-to", default="binary_tree")
    p.add_argument("--min-gain", type=float, default=0.3)
    p.add_argument("--kungfu-run", default=os.environ.get(
        "KUNGFU_RUN", str(ROOT / "target" / "release" / "kungfu-run")))
    p.add_argument("--python", default=sys.executable)
    a = p.parse_args()
    if a.short:
        a.rounds = 1
    if a.out is None:
        a.out = tempfile.mkdtemp(prefix="kungfu-adapt-") if a.short else str(
            ROOT / "docs" / "bench" / "adaptation")
    for name in a.only:
        t0 = time.time()
        EXPERIMENTS[name](a)
        print(f"run.py: {name} done in {time.time() - t0:.0f} s ({a.out})", flush=True)


if __name__ == "__main__":
    main()
