#!/usr/bin/env python3
"""kungfu-sim against measured runs on a namespace cluster (run as root).

    benches/peers/sim_validate.py [--rate-mb 100] [--sizes 1M 64M]
                                  [--strategies ...] [--iters 3] [--json FILE]

Makes 2 "hosts" with scripts/netns-cluster.sh (198.18.0.1 and .2), runs
`kungfu-bench allreduce` on 2 hosts x 2 workers for each strategy and size,
in per-node mode (one kungfu-run per host; shared memory inside a host, TCP
between them), with every worker's egress over TCP shaped to --rate-mb MB/s (KUNGFU_FAULTS=rate_mb=R: this kernel has no
netem), and prints the measured busbw beside kungfu-sim's prediction for
the same layout: links of R MB/s, the latency and per-frame costs given
(--latency-us, --overhead-us, --intra-gbps, --cpu-gbps; defaults measured
on this machine's loopback). The ratio is predicted / measured; over 25%
off is flagged with "!".

Shared memory inside a host is not shaped, and each worker has a shaper of
its own, so the model gets a link per worker (`kungfu-sim --links worker`);
the shapers limit only what a worker sends, whereas the model's links
limit what it receives too.

--json FILE writes the results as one table, `sim-vs-measured`
(benches/peers/tables.py: the format the docs' tables are rendered from):
a row per strategy, per size the columns `SIZE measured`, `predicted` and
`ratio`, and a last column `off` naming the sizes flagged with "!".
"""

import argparse
import os
import re
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import human  # noqa: E402
from tables import Table, write_json  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.path.join(ROOT, "target", "release")
SCRIPT = os.path.join(ROOT, "scripts", "netns-cluster.sh")
HOSTS = "198.18.0.1:2,198.18.0.2:2"
SECRET = os.urandom(16).hex()


def size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def measure(prefix, strategy, nbytes, iters, rate):
    """Per-node mode: one launcher per host; rank 0's time per op (us)."""
    outs = {}

    def launch(host):
        me = f"198.18.0.{host}"
        cmd = ["ip", "netns", "exec", f"{prefix}-h{host}", os.path.join(BIN, "kungfu-run"),
               "--timeout", "300s", "-np", "4", "-H", HOSTS, "--self", me, "--cluster-id", "5eed",
               "--transport", "auto", "--strategy", strategy, os.path.join(BIN, "kungfu-bench"),
               "allreduce", "-b", str(nbytes), "-e", str(nbytes), "-n", str(iters), "-w", "1",
               "-c", "0"]
        env = dict(os.environ, KUNGFU_JOB_SECRET=SECRET, KUNGFU_FAULTS=f"rate_mb={rate}")
        outs[host] = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)

    threads = [threading.Thread(target=launch, args=(h,)) for h in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h, r in outs.items():
        if r.returncode != 0:
            sys.exit(f"host {h}, {strategy} {nbytes}: failed\n{r.stdout}\n{r.stderr}")
    for line in outs[1].stdout.splitlines():
        f = line.split()
        if len(f) > 7 and f[0].startswith("[0@") and f[1] == str(nbytes):
            return float(f[6])
    sys.exit(f"no row for {nbytes} bytes:\n{outs[1].stdout}")


def predict(a, strategy, nbytes):
    cmd = [os.path.join(BIN, "kungfu-sim"), "--workers", "4", "--per-host", "2",
           "--sizes", str(nbytes), "--strategies", strategy,
           "--link-gbps", str(a.rate_mb * 8e6 / 1e9), "--latency-us", str(a.latency_us),
           "--overhead-us", str(a.overhead_us), "--intra-gbps", str(a.intra_gbps),
           "--cpu-gbps", str(a.cpu_gbps), "--links", "worker"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        f = line.split()
        if len(f) == 8 and f[0] == strategy and f[1] == "4":
            return float(f[2])
    sys.exit(f"no prediction:\n{out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate-mb", type=float, default=100)
    ap.add_argument("--sizes", nargs="+", default=["1M", "64M"])
    ap.add_argument("--strategies", nargs="+", default=[
        "STAR", "RING", "TREE", "BINARY_TREE", "BINARY_TREE_STAR", "MULTI_BINARY_TREE_STAR",
        "CLIQUE", "RECURSIVE_DOUBLING", "AUTO"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--latency-us", type=float, default=30)
    ap.add_argument("--overhead-us", type=float, default=15)
    ap.add_argument("--intra-gbps", type=float, default=24)
    ap.add_argument("--cpu-gbps", type=float, default=24)
    ap.add_argument("--json", help="write the table here")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "kungfu-tools"], cwd=ROOT,
                   check=True, capture_output=True)
    prefix = f"kfv{os.getpid()}"
    # (strategy, size) -> measured and predicted busbw, ratio, flag, as printed
    got = {}
    subprocess.run([SCRIPT, "up", "2", prefix], check=True)
    try:
        print(f"## allreduce, 2 hosts x 2 workers, TCP between hosts shaped to {a.rate_mb:g} MB/s "
              f"per worker; busbw in GB/s")
        print(f"{'strategy':>22} {'size':>9} {'measured':>9} {'predicted':>9} {'ratio':>6}")
        for s in a.sizes:
            nbytes = size(s)
            for st in a.strategies:
                t_meas = measure(prefix, st, nbytes, a.iters, a.rate_mb)
                t_pred = predict(a, st, nbytes)
                bw = lambda t: nbytes / t / 1e3 * 2 * 3 / 4
                ratio = t_meas / t_pred
                flag = "!" if abs(ratio - 1) > 0.25 else ""
                got[(st, s)] = (bw(t_meas), bw(t_pred), bw(t_pred) / bw(t_meas), flag)
                print(f"{st:>22} {s:>9} {bw(t_meas):9.3f} {bw(t_pred):9.3f} {bw(t_pred) / bw(t_meas):6.2f}{flag}",
                      flush=True)
    finally:
        subprocess.run([SCRIPT, "down", prefix])
    if a.json:
        table = Table("sim-vs-measured", f"allreduce, 2 hosts x 2 workers, TCP between hosts shaped to "
                      f"{a.rate_mb:g} MB/s per worker; busbw (GB/s) measured and predicted by kungfu-sim, "
                      "ratio = predicted / measured; off: the sizes more than 25% off",
                      ["strategy"] + [c for s in a.sizes
                                      for c in (f"{human(size(s))} measured", "predicted", "ratio")] + ["off"],
                      ["{}"] + ["{:.3f}", "{:.3f}", "{:.2f}"] * len(a.sizes) + ["{}"])
        for st in a.strategies:
            row = [got[(st, s)] for s in a.sizes]
            table.add(st, *[x for r in row for x in r[:3]],
                      ", ".join(human(size(s)) for s, r in zip(a.sizes, row) if r[3]))
        write_json(a.json, [table], rate_mb=a.rate_mb, iters=a.iters, latency_us=a.latency_us,
                   overhead_us=a.overhead_us, intra_gbps=a.intra_gbps, cpu_gbps=a.cpu_gbps)
        print(f"\n(table written to {a.json})")


if __name__ == "__main__":
    main()
