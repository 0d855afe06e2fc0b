#!/usr/bin/env python3
"""KungFu-rs against Open MPI, measured alternately in the same run.

    benches/peers/compare.py [--np 2 4] [--ops allreduce broadcast allgather]
                             [--rounds 5] [--transport default|tcp]
                             [--min 4] [--max 64M] [--iters 20] [--warmup 5]
                             [--plot DIR] [--json FILE]
                             [--kungfu LABEL=DIR ...] [--no-mpi]

Builds kungfu-bench (release) and benches/peers/mpi_bench.c (mpicc), then
for each np and op runs the two one after the other, --rounds times, and
prints per size the median busbw of each, the ratio KungFu-rs / Open MPI of
busbw, and for sizes up to 1 KiB the ratio of time per op (lower is better
for KungFu-rs). Both use f32, out of place, the same sizes, the same
iteration rule (warmup, then iters back to back; the slowest rank's mean).

--transport default: Open MPI with its defaults (shared memory inside the
host) against KungFu-rs's host-aware transport (`--transport auto`: shared
memory inside the host); tcp: Open MPI forced onto TCP over loopback
(--mca btl tcp,self --mca btl_tcp_if_include lo) against KungFu-rs's TCP
transport. Machines are shared and noisy: read the ratios,
and the spread between rounds, not single numbers.

At the end it prints a summary, table `busbw-ratios`: per op and np the
busbw ratio of the second series (the first build of KungFu-rs, or with
--no-mpi the second build) to the first at 4 KiB, 64 KiB, 1 MiB, 16 MiB and
64 MiB ("-" for a size the sweep left out). Then table `peak-rss`: per op
and np, the peak resident set of the largest rank of each series over its
whole sweep (so at its largest size; the median of the rounds, MiB), and
the ratio of the second series to the first.

--json FILE writes every table printed, one per op and np (`OP-npN`) and
the summary (benches/peers/tables.py: the format the docs' tables are
rendered from); with --plot DIR and no --json, it goes to
DIR/compare-TRANSPORT.json beside the plots.

--kungfu LABEL=DIR (repeatable) compares builds of KungFu-rs with each other
instead of (or, without --no-mpi, besides) this tree's: each DIR holds a
kungfu-run and a kungfu-bench (e.g. the release binaries of an older
commit, copied aside), and each runs under its own kungfu-run. Every round
runs each build once, in the order given, so the builds alternate. Ratios
are against the first series (Open MPI, or with --no-mpi the first build);
a busbw ratio below 0.90 is flagged with "!".
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tables import Table, render, write_json  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# the sizes of the summary table (busbw-ratios)
SUMMARY_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def human(n):
    """A size as the docs write it: 4 KiB, 1 MiB, 12 B."""
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def ratio(x, y):
    return x / y if y > 0 else float("nan")


def run(cmd, env=None, timeout=1800):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def build_mpi(workdir):
    exe = os.path.join(workdir, "mpi_bench")
    run(["mpicc", "-O2", "-o", exe, os.path.join(ROOT, "benches", "peers", "mpi_bench.c")])
    return exe


def peak_rss(text):
    """The '# Peak RSS (largest rank): X MiB' line of either bench (MiB)."""
    for line in text.splitlines():
        if "# Peak RSS (largest rank):" in line:
            return float(line.split(":")[-1].split()[0])
    return float("nan")


def kungfu(np_, op, a, workdir, rel):
    """{size: (busbw, us)} and the peak RSS (MiB) of one run."""
    out = os.path.join(workdir, "kf.json")
    transport = "tcp" if a.transport == "tcp" else "auto"
    text = run([os.path.join(rel, "kungfu-run"), "-np", str(np_), "--timeout", "20m", "--transport",
                transport, os.path.join(rel, "kungfu-bench"), op, "-b", str(a.min), "-e",
                str(a.max), "-f", "4", "-n", str(a.iters), "-w", str(a.warmup), "-c", "1",
                "--in-place", "0", "--json", out])
    with open(out) as f:
        rows = json.load(f)["rows"]
    return ({r["size"]: (r["out_of_place"]["busbw_gbps"], r["out_of_place"]["time_us"])
             for r in rows}, peak_rss(text))


def mpi(np_, op, a, exe):
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if a.transport == "tcp":
        cmd += ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
    cmd += [exe, op, "-b", str(a.min), "-e", str(a.max), "-f", "4", "-n", str(a.iters),
            "-w", str(a.warmup), "-c", "1"]
    res = {}
    text = run(cmd)
    for line in text.splitlines():
        f = line.split()
        if f and not line.startswith("#"):
            res[int(f[0])] = (float(f[7]), float(f[5]))
    return res, peak_rss(text)


def svg(title, series):
    """A line plot of busbw (GB/s) against size (log scale): series is a list
    of (label, colour, {size: busbw})."""
    w, h, l, r, t, b = 720, 420, 70, 20, 40, 60
    sizes = sorted({s for _, _, pts in series for s in pts})
    top = max([v for _, _, pts in series for v in pts.values()] + [1e-9]) * 1.1
    lo, hi = math.log2(max(sizes[0], 1)), math.log2(max(sizes[-1], 2))
    x = lambda s: l + (math.log2(max(s, 1)) - lo) / max(hi - lo, 1) * (w - l - r)
    y = lambda v: h - b - v / top * (h - t - b)
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
         f'<rect width="{w}" height="{h}" fill="white"/>',
         f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
         f'<line x1="{l}" y1="{h - b}" x2="{w - r}" y2="{h - b}" stroke="black"/>',
         f'<line x1="{l}" y1="{t}" x2="{l}" y2="{h - b}" stroke="black"/>',
         f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">message size (bytes)</text>',
         f'<text x="18" y="{h / 2}" text-anchor="middle" transform="rotate(-90 18 {h / 2})">busbw (GB/s)</text>']
    for s in sizes[::2]:
        label = next((f"{s >> k}{u}" for k, u in ((30, "G"), (20, "M"), (10, "K")) if s >= 1 << k), str(s))
        o.append(f'<text x="{x(s):.1f}" y="{h - b + 16}" text-anchor="middle">{label}</text>')
    for i in range(6):
        v = top * i / 5
        o.append(f'<text x="{l - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>')
        o.append(f'<line x1="{l}" y1="{y(v):.1f}" x2="{w - r}" y2="{y(v):.1f}" stroke="#ddd"/>')
    for k, (label, colour, pts) in enumerate(series):
        path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in sorted(pts.items()))
        o.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        o.append(f'<text x="{l + 12}" y="{t + 16 + 16 * k}" fill="{colour}">{label}</text>')
    o.append("</svg>")
    return "\n".join(o) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ops", nargs="+", default=["allreduce", "broadcast", "allgather"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--transport", choices=["default", "tcp"], default="default")
    p.add_argument("--min", type=size, default=4)
    p.add_argument("--max", type=size, default=64 << 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--plot", help="write one SVG per np and op into this directory")
    p.add_argument("--json", help="write the tables here (default with --plot: "
                                  "PLOT/compare-TRANSPORT.json)")
    p.add_argument("--kungfu", action="append", default=[], metavar="LABEL=DIR",
                   help="a build to compare: DIR holds kungfu-run and kungfu-bench")
    p.add_argument("--no-mpi", action="store_true", help="leave Open MPI out")
    a = p.parse_args()
    builds = []
    for kv in a.kungfu:
        label, sep, d = kv.partition("=")
        if not sep or not all(os.access(os.path.join(d, b), os.X_OK) for b in ("kungfu-run", "kungfu-bench")):
            sys.exit(f"--kungfu {kv}: want LABEL=DIR, DIR holding kungfu-run and kungfu-bench")
        builds.append((label, os.path.abspath(d)))
    if a.no_mpi and len(builds) < 2:
        sys.exit("--no-mpi needs at least two --kungfu builds to compare")
    if a.plot:
        os.makedirs(a.plot, exist_ok=True)
    colours = ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    tables = []
    with tempfile.TemporaryDirectory(prefix="kungfu-compare-") as workdir:
        if not builds:
            run(["cargo", "build", "--release", "--locked", "-q", "-p", "kungfu-tools", "--bins"])
            builds = [("KungFu-rs", os.path.join(ROOT, "target", "release"))]
        exe = None if a.no_mpi else build_mpi(workdir)
        labels = ([] if a.no_mpi else ["Open MPI"]) + [l for l, _ in builds]
        # (op, np) -> busbw of labels[1] / labels[0] per size of SUMMARY_SIZES
        summary = {}
        # (op, np) -> the median peak RSS (MiB) of each series
        rss = {}
        for np_ in a.np:
            for op in a.ops:
                series = [(l, {}) for l in labels]
                peaks = [[] for _ in labels]
                for _ in range(a.rounds):
                    k = 0
                    if not a.no_mpi:
                        got, peak = mpi(np_, op, a, exe)
                        for s, v in got.items():
                            series[0][1].setdefault(s, []).append(v)
                        peaks[0].append(peak)
                        k = 1
                    for j, (_, d) in enumerate(builds):
                        got, peak = kungfu(np_, op, a, workdir, d)
                        for s, v in got.items():
                            series[k + j][1].setdefault(s, []).append(v)
                        peaks[k + j].append(peak)
                rss[(op, np_)] = [statistics.median(p) for p in peaks]
                print(f"\n## {op}, np={np_}, transport {a.transport}, median of {a.rounds} rounds; "
                      f"ratios against {series[0][0]}")
                med = lambda d, i: {s: statistics.median(x[i] for x in v) for s, v in d.items()}
                bw = [med(d, 0) for _, d in series]
                us = [med(d, 1) for _, d in series]
                head = f"{'size':>10}"
                for l, _ in series:
                    head += f" {l[:12] + ' GB/s':>17} {l[:12] + ' us':>15}"
                for l, _ in series[1:]:
                    head += f" {'bw ' + l[:10]:>14} {'t ' + l[:10]:>13}"
                print(head)
                table = Table(f"{op}-np{np_}", f"{op}, np={np_}, transport {a.transport}, busbw (GB/s) and "
                          f"time per op (us), median of {a.rounds} rounds; ratios against "
                          f"{series[0][0]}",
                          ["size (B)"] + [f"{l} GB/s" for l, _ in series] + [f"{l} us" for l, _ in series]
                          + [f"busbw {l}" for l, _ in series[1:]] + [f"time {l}" for l, _ in series[1:]],
                          ["{}"] + ["{:.3f}"] * len(series) + ["{:.1f}"] * len(series)
                          + ["{:.2f}"] * (2 * (len(series) - 1)))
                tables.append(table)
                for s in sorted(set.intersection(*(set(b) for b in bw))):
                    row = f"{s:>10}"
                    for b, t in zip(bw, us):
                        row += f" {b[s]:17.3f} {t[s]:15.1f}"
                    for b, t in zip(bw[1:], us[1:]):
                        r = b[s] / bw[0][s] if bw[0][s] > 0 else float("nan")
                        flag = "!" if r < 0.90 else " "
                        tr = f"{t[s] / us[0][s]:13.2f}" if s <= 1024 and us[0][s] > 0 else f"{'-':>13}"
                        row += f" {r:13.2f}{flag} {tr}"
                    print(row)
                    table.add(s, *[b[s] for b in bw], *[u[s] for u in us],
                          *[ratio(b[s], bw[0][s]) for b in bw[1:]],
                          *[ratio(u[s], us[0][s]) if s <= 1024 else float("nan") for u in us[1:]])
                summary[(op, np_)] = [ratio(bw[1][s], bw[0][s]) if s in bw[0] and s in bw[1]
                                      else None for s in SUMMARY_SIZES]
                sys.stdout.flush()
                if a.plot:
                    name = os.path.join(a.plot, f"{op}-np{np_}-{a.transport}.svg")
                    title = f"{op}, np={np_}, {a.transport} transport: busbw, median of {a.rounds}"
                    pts = [(l, colours[i % len(colours)] if l != "Open MPI" else "#1f77b4", b)
                           for i, ((l, _), b) in enumerate(zip(series, bw))]
                    with open(name, "w") as f:
                        f.write(svg(title, pts))
        ratios = Table("busbw-ratios", f"busbw ratio {labels[1]} / {labels[0]} per op and np, transport "
                       f"{a.transport}, median of {a.rounds} rounds",
                       ["op", "np"] + [human(s) for s in SUMMARY_SIZES],
                       ["{}", "{}"] + ["{:.2f}"] * len(SUMMARY_SIZES))
        for op in a.ops:
            for np_ in a.np:
                ratios.add(op, np_, *summary[(op, np_)])
        tables.append(ratios)
        print(f"\n## {ratios.title}\n{render(ratios.to_json())}")
        peak = Table("peak-rss", f"peak resident set of the largest rank over the sweep (to "
                     f"{human(a.max)}), MiB, median of {a.rounds} rounds; ratio {labels[1]} / "
                     f"{labels[0]}", ["op", "np"] + labels + ["ratio"],
                     ["{}", "{}"] + ["{:.1f}"] * len(labels) + ["{:.2f}"])
        for op in a.ops:
            for np_ in a.np:
                m = rss[(op, np_)]
                peak.add(op, np_, *m, ratio(m[1], m[0]))
        tables.append(peak)
        print(f"\n## {peak.title}\n{render(peak.to_json())}")
        out = a.json or (a.plot and os.path.join(a.plot, f"compare-{a.transport}.json"))
        if out:
            write_json(out, tables, rounds=a.rounds, transport=a.transport,
                       iters=a.iters, warmup=a.warmup)
            print(f"\n(tables written to {out})")


if __name__ == "__main__":
    main()
