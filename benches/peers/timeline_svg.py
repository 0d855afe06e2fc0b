#!/usr/bin/env python3
"""Draws KungFu-rs timelines (KUNGFU_TIMELINE / kungfu-bench --timeline) as
one SVG: a row per rank and peer, a box per span, coloured by kind.

    benches/peers/timeline_svg.py OUT.svg TRACE.rank0.json TRACE.rank1.json ...
                                  [--from US] [--to US] [--match TEXT]

--from/--to cut a window, in microseconds from the first event drawn
(the workers of a host stamp events on one clock, so their rows line up);
--match starts the window at the first op whose name contains TEXT.
Perfetto (https://ui.perfetto.dev) opens the same files interactively.
"""

import argparse
import json
import sys

COLOURS = {"allreduce": "#1f77b4", "broadcast": "#2ca02c", "allgather": "#9467bd",
           "send": "#ff7f0e", "recv": "#d62728", "fast": "#8c564b", "queued": "#7f7f7f"}


def load(path):
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("traces", nargs="+")
    p.add_argument("--from", dest="lo", type=float, default=None)
    p.add_argument("--to", dest="hi", type=float, default=None)
    p.add_argument("--match", default=None, help="align ranks on the first op whose name contains this")
    a = p.parse_args()
    rows, names, spans = [], {}, []
    for path in a.traces:
        ev = load(path)
        for e in ev:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                names[(e["pid"], e["tid"])] = e["args"]["name"]
            elif e.get("ph") == "X":
                spans.append((e["pid"], e["tid"], e["ts"], e.get("dur", 0), e.get("cat", ""), e["name"]))
    if not spans:
        sys.exit("no spans")
    origin = min(s[2] for s in spans)
    if a.match:
        hits = [s[2] for s in spans if s[1] == 0 and a.match in s[5]]
        origin = min(hits) if hits else origin
    spans = [(p, t, ts - origin, d, c, n) for p, t, ts, d, c, n in spans]
    if a.match and a.lo is None:
        a.lo = 0.0
    if a.lo is not None:
        spans = [s for s in spans if s[2] + s[3] >= a.lo]
    if a.hi is not None:
        spans = [s for s in spans if s[2] <= a.hi]
    if not spans:
        sys.exit("no spans in the window")
    rows = sorted({(s[0], s[1]) for s in spans})
    lo = a.lo if a.lo is not None else min(s[2] for s in spans)
    hi = a.hi if a.hi is not None else max(s[2] + s[3] for s in spans)
    w, left, top, rh = 1100, 130, 40, 22
    h = top + rh * len(rows) + 50
    x = lambda t: left + (t - lo) / max(hi - lo, 1e-9) * (w - left - 20)
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
         f'<rect width="{w}" height="{h}" fill="white"/>',
         f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">KungFu-rs timeline: {hi - lo:.0f} us</text>']
    for i, (pid, tid) in enumerate(rows):
        y = top + i * rh
        label = f"rank {pid} " + names.get((pid, tid), "ops" if tid == 0 else f"peer {tid - 1}")
        o.append(f'<text x="4" y="{y + 15}">{label}</text>')
        o.append(f'<line x1="{left}" y1="{y + rh}" x2="{w - 20}" y2="{y + rh}" stroke="#eee"/>')
    for pid, tid, ts, dur, cat, name in spans:
        y = top + rows.index((pid, tid)) * rh + 3
        x0, x1 = x(max(ts, lo)), x(min(ts + dur, hi))
        c = COLOURS.get(cat, "#17becf")
        o.append(f'<rect x="{x0:.2f}" y="{y}" width="{max(x1 - x0, 0.6):.2f}" height="{rh - 6}" fill="{c}" '
                 f'fill-opacity="0.8"><title>{name} ({cat}) {dur:.1f} us</title></rect>')
    for k in range(6):
        t = lo + (hi - lo) * k / 5
        o.append(f'<text x="{x(t):.1f}" y="{h - 20}" text-anchor="middle">{t - lo:.0f} us</text>')
    legend = " ".join(f'<tspan fill="{c}">{n}</tspan>' for n, c in COLOURS.items())
    o.append(f'<text x="{left}" y="{h - 5}">{legend}</text>')
    o.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(o) + "\n")
    print(f"{a.out}: {len(spans)} spans, {len(rows)} rows, {hi - lo:.0f} us")


if __name__ == "__main__":
    main()
