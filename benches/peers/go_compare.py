#!/usr/bin/env python3
"""KungFu-rs against the original KungFu (Go), both over TCP, alternately.

    benches/peers/go_compare.py --go-src DIR [--np 2 4] [--rounds 3]
                                [--kungfu DIR] [--in-place] [--json FILE]

DIR is a checkout of lsds/KungFu (`fetch github:lsds/KungFu`, then `git
clone` its mirror); its Go module has no dependencies and builds with
Debian's golang-go. The script builds, into a scratch directory:
- KungFu's kungfu-run;
- benches/peers/kungfu-go, a sized allreduce benchmark that calls KungFu's
  sess.AllReduce as KungFu's own kungfu-bench-allreduce does, on one
  float32 buffer of each size;
and builds both with KungFu's `UseUnixSock` turned off through a go build
overlay (the checkout is not changed): KungFu otherwise sends between
workers of one host over Unix sockets, and this compares TCP with TCP.

KungFu-rs runs `kungfu-bench allreduce` with `--transport tcp`, from
--kungfu DIR (kungfu-run and kungfu-bench; default: this tree's release
build, built first), out of place unless --in-place. Every round runs each
size on both, one after the other; the script prints per np and size the
median time per op of each, busbw (2(n-1)/n x bytes / time) and the ratio
of KungFu-rs's busbw to KungFu's (higher is better).

--json FILE writes the busbw and the ratio as one table, `go-vs-rs`
(benches/peers/tables.py: the format the docs' tables are rendered from):
a row per np and size, the columns `np`, `size`, `KungFu GB/s`,
`KungFu-rs GB/s` and `ratio` (KungFu-rs / KungFu).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import human  # noqa: E402
from tables import Table, write_json  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SIZES = [(64 << 10, 200), (1 << 20, 100), (16 << 20, 20), (64 << 20, 10)]


def run(cmd, cwd=None, env=None, timeout=600):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def build_go(src, out):
    """KungFu's kungfu-run and the sized benchmark, TCP between local workers."""
    src = os.path.abspath(src)
    config = os.path.join(src, "srcs", "go", "kungfu", "config", "config.go")
    text = open(config).read()
    if "UseUnixSock = true" not in text:
        sys.exit(f"{config}: no 'UseUnixSock = true' to turn off (another KungFu version?)")
    patched = os.path.join(out, "config.go")
    open(patched, "w").write(text.replace("UseUnixSock = true", "UseUnixSock = false"))
    overlay = os.path.join(out, "overlay.json")
    json.dump({"Replace": {config: patched}}, open(overlay, "w"))
    bench = os.path.join(out, "kungfu-go")
    shutil.copytree(os.path.join(ROOT, "benches", "peers", "kungfu-go"), bench)
    mod = os.path.join(bench, "go.mod")
    text = open(mod).read().replace("=> ../src", f"=> {src}")
    open(mod, "w").write(text)
    env = dict(os.environ, GOFLAGS="-mod=mod", GOPATH=os.path.join(out, "gopath"),
               GOCACHE=os.path.join(out, "gocache"))
    flags = ["-overlay", overlay, "-o", out + "/"]
    run(["go", "build", *flags, "./srcs/go/cmd/kungfu-run"], cwd=src, env=env)
    run(["go", "build", *flags, "./cmd/kungfu-bench-allreduce-size"], cwd=bench, env=env)
    return os.path.join(out, "kungfu-run"), os.path.join(out, "kungfu-bench-allreduce-size")


def go_time(run_go, bench_go, np_, size, iters):
    # KungFu's launcher writes a log file per worker into its working
    # directory: the scratch directory it was built in, not the caller's
    out = run([run_go, "-q", "-timeout", "5m", "-np", str(np_), "-H", f"127.0.0.1:{np_}",
               bench_go, "-size", str(size), "-iters", str(iters), "-warmup", "3"],
              cwd=os.path.dirname(run_go))
    m = re.search(r"per_op_us=([\d.]+)", out)
    if not m:
        sys.exit(f"no RESULT line from KungFu:\n{out}")
    return float(m.group(1))


def rs_time(kf, np_, size, iters, in_place):
    out = run([os.path.join(kf, "kungfu-run"), "-np", str(np_), "--transport", "tcp",
               os.path.join(kf, "kungfu-bench"), "allreduce", "-b", str(size), "-e", str(size),
               "-n", str(iters), "-w", "3", "-c", "0", "--in-place", "1" if in_place else "0"])
    for line in out.splitlines():
        f = line.split()
        # the bench's row on rank 0: [0] size count type redop root time ...
        if len(f) > 7 and f[0] == "[0]" and f[1] == str(size):
            return float(f[6])
    sys.exit(f"no row for {size} bytes from kungfu-bench:\n{out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--go-src", required=True, help="a checkout of lsds/KungFu")
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kungfu", help="a directory with kungfu-run and kungfu-bench")
    ap.add_argument("--in-place", action="store_true")
    ap.add_argument("--json", help="write the table here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kf-go-") as tmp:
        run_go, bench_go = build_go(a.go_src, tmp)
        kf = a.kungfu
        if not kf:
            run(["cargo", "build", "--release", "--locked", "-p", "kungfu-tools"], cwd=ROOT, timeout=1800)
            kf = os.path.join(ROOT, "target", "release")
        times = {}
        for r in range(a.rounds):
            for np_ in a.np:
                for size, iters in SIZES:
                    g = go_time(run_go, bench_go, np_, size, iters)
                    s = rs_time(kf, np_, size, iters, a.in_place)
                    times.setdefault((np_, size), ([], []))
                    times[(np_, size)][0].append(g)
                    times[(np_, size)][1].append(s)
                    print(f"round {r}: np={np_} {size:>9} B  KungFu {g:10.1f} us  KungFu-rs {s:10.1f} us",
                          file=sys.stderr, flush=True)
    mode = "in place" if a.in_place else "out of place"
    print(f"## allreduce over TCP, median of {a.rounds} rounds ({mode} for KungFu-rs)")
    print(f"{'np':>3} {'size':>9} {'KungFu us':>11} {'KungFu-rs us':>13} "
          f"{'KungFu GB/s':>12} {'KungFu-rs GB/s':>15} {'ratio':>6}")
    table = Table("go-vs-rs", f"allreduce over TCP, KungFu (Go) against KungFu-rs ({mode}), busbw (GB/s), "
                  f"median of {a.rounds} rounds; ratio = KungFu-rs / KungFu",
                  ["np", "size", "KungFu GB/s", "KungFu-rs GB/s", "ratio"],
                  ["{}", "{}", "{:.3f}", "{:.3f}", "{:.2f}"])
    for (np_, size), (g, s) in sorted(times.items()):
        g, s = statistics.median(g), statistics.median(s)
        f = 2 * (np_ - 1) / np_
        print(f"{np_:>3} {size:>9} {g:11.1f} {s:13.1f} {size / g / 1e3 * f:12.3f} "
              f"{size / s / 1e3 * f:15.3f} {g / s:6.2f}")
        table.add(np_, human(size), size / g / 1e3 * f, size / s / 1e3 * f, g / s)
    if a.json:
        write_json(a.json, [table], rounds=a.rounds, in_place=a.in_place)
        print(f"\n(table written to {a.json})")


if __name__ == "__main__":
    main()
