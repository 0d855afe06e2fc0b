#!/usr/bin/env python3
"""Allreduce busbw per transport, and Open MPI's TCP btl, in one run.

    benches/peers/transports.py [--np 2 4] [--rounds 3] [--sizes 1M 64M]
                                [--iters 10] [--warmup 3] [--json FILE]

Builds kungfu-bench (release) and benches/peers/mpi_bench.c, then for each
np runs, round after round, an allreduce (f32, out of place, checked) over
each of KungFu-rs's transports available here (tcp, quic, fabric over
libfabric's tcp;ofi_rxm and shm providers, shm) and Open MPI forced onto
TCP over loopback (--mca btl tcp,self), one after the other, so that all
see the same machine. Prints per np and size the median busbw of each
over the rounds and its ratio to our TCP and to Open MPI's TCP.

--json FILE writes the medians as one table, `busbw-per-transport`
(benches/peers/tables.py: the format the docs' tables are rendered from):
a row per transport as printed, and per np and size two columns, the busbw
(`np=2, 1 MiB GB/s`) and its ratio to our TCP (`np=2, 1 MiB / tcp`).
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from compare import ROOT, build_mpi, human, mpi, run, size  # noqa: E402
from tables import Table, write_json  # noqa: E402

TRANSPORTS = [
    ("tcp", "tcp", {}),
    ("quic", "quic", {}),
    ("fabric tcp;ofi_rxm", "fabric", {"KUNGFU_FABRIC_PROVIDER": "tcp;ofi_rxm"}),
    ("fabric shm", "fabric", {"KUNGFU_FABRIC_PROVIDER": "shm"}),
    ("shm", "shm", {}),
]


def kungfu(np_, transport, env, a, workdir):
    import json
    rel = os.path.join(ROOT, "target", "release")
    out = os.path.join(workdir, "kf.json")
    cmd = [os.path.join(rel, "kungfu-run"), "-np", str(np_), "--timeout", "20m", "--transport", transport]
    for k, v in env.items():
        cmd += ["-x", f"{k}={v}"]
    cmd += [os.path.join(rel, "kungfu-bench"), "allreduce", "-b", str(a.sizes[0]), "-e", str(a.sizes[-1]),
            "-f", str(a.factor), "-n", str(a.iters), "-w", str(a.warmup), "-c", "1", "--in-place", "0",
            "--json", out]
    run(cmd)
    with open(out) as f:
        rows = json.load(f)["rows"]
    return {r["size"]: r["out_of_place"]["busbw_gbps"] for r in rows}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", type=size, nargs="+", default=[1 << 20, 64 << 20])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the table of medians here")
    a = p.parse_args()
    a.sizes.sort()
    # every size asked for is a row of one sweep: the factor between them
    # (a power of two), the others in between are dropped
    ratio = a.sizes[-1] // a.sizes[0] if len(a.sizes) > 1 else 2
    a.factor = ratio if len(a.sizes) == 2 else 2
    mpi_args = argparse.Namespace(transport="tcp", min=a.sizes[0], max=a.sizes[-1], iters=a.iters,
                                  warmup=a.warmup)
    labels = [l for l, _, _ in TRANSPORTS] + ["Open MPI tcp"]
    # label -> the cells of its row in the JSON table: per np and size,
    # busbw and its ratio to our tcp, as printed
    cells = {label: [] for label in labels}
    with tempfile.TemporaryDirectory(prefix="kungfu-transports-") as workdir:
        run(["cargo", "build", "--release", "--locked", "-q", "-p", "kungfu-tools", "--bins"])
        exe = build_mpi(workdir)
        for np_ in a.np:
            got = {label: {} for label, _, _ in TRANSPORTS}
            got["Open MPI tcp"] = {}
            for _ in range(a.rounds):
                for s, (bw, _) in mpi(np_, "allreduce", mpi_args, exe).items():
                    got["Open MPI tcp"].setdefault(s, []).append(bw)
                for label, t, env in TRANSPORTS:
                    for s, bw in kungfu(np_, t, env, a, workdir).items():
                        got[label].setdefault(s, []).append(bw)
            print(f"\n## allreduce busbw (GB/s), np={np_}, median of {a.rounds} rounds "
                  f"(ratios: to our tcp / to Open MPI tcp)")
            head = f"{'transport':<20}" + "".join(f" {s >> 20:>8} MiB {'':>14}" for s in a.sizes)
            print(head)
            med = {k: {s: statistics.median(v) for s, v in d.items()} for k, d in got.items()}
            for label in labels:
                row = f"{label:<20}"
                for s in a.sizes:
                    bw = med[label].get(s, float("nan"))
                    tcp, ompi = med["tcp"].get(s, float("nan")), med["Open MPI tcp"].get(s, float("nan"))
                    row += f" {bw:12.3f} {bw / tcp:6.2f} / {bw / ompi:5.2f}"
                    cells[label] += [bw, bw / tcp]
                print(row)
            sys.stdout.flush()
    if a.json:
        table = Table("busbw-per-transport", f"allreduce busbw (GB/s) per transport, median of {a.rounds} "
                      "rounds, and its ratio to our tcp",
                      ["transport"] + [f"np={np_}, {human(s)}{c}" for np_ in a.np for s in a.sizes
                                       for c in (" GB/s", " / tcp")],
                      ["{}"] + ["{:.2f}"] * (2 * len(a.np) * len(a.sizes)))
        for label in labels:
            table.add(label, *cells[label])
        write_json(a.json, [table], rounds=a.rounds, iters=a.iters, warmup=a.warmup)
        print(f"\n(table written to {a.json})")


if __name__ == "__main__":
    main()
