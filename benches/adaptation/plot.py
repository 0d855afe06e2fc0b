"""SVG line plots for the adaptation experiments (no plotting library:
the torch venv has none, and a figure is a few lines of SVG).

    svg(title, xlabel, ylabel, series, marks=())

`series`: (label, colour, [(x, y), ...]); `marks`: (x, label) vertical
lines (a resize, a slowdown, a switch).
"""

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#7f7f7f"]


def _ticks(lo, hi, n=5):
    if hi <= lo:
        hi = lo + 1
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def _fmt(v):
    return f"{v:.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.2g}"


def svg(title, xlabel, ylabel, series, marks=(), ymin=None, ymax=None):
    w, h, left, right, top, bottom = 760, 440, 70, 20, 40, 60
    pts = [p for _, _, s in series for p in s]
    if not pts:
        raise ValueError(f"{title}: nothing to plot")
    x0, x1 = min(0.0, min(p[0] for p in pts)), max(p[0] for p in pts)
    y0 = min(p[1] for p in pts) if ymin is None else ymin
    y1 = max(p[1] for p in pts) if ymax is None else ymax
    if y1 <= y0:
        y1 = y0 + 1
    x1 = x1 if x1 > x0 else x0 + 1
    def px(x):
        return left + (x - x0) / (x1 - x0) * (w - left - right)

    def py(y):
        return h - bottom - (y - y0) / (y1 - y0) * (h - top - bottom)

    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
         'font-family="sans-serif" font-size="12">',
         f'<rect width="{w}" height="{h}" fill="white"/>',
         f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
         f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
         f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
         f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">{xlabel}</text>',
         f'<text x="18" y="{h / 2}" text-anchor="middle" '
         f'transform="rotate(-90 18 {h / 2})">{ylabel}</text>']
    for v in _ticks(x0, x1):
        o.append(f'<text x="{px(v):.1f}" y="{h - bottom + 16}" text-anchor="middle">{_fmt(v)}</text>')
    for v in _ticks(y0, y1):
        o.append(f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
        o.append(f'<line x1="{left}" y1="{py(v):.1f}" x2="{w - right}" y2="{py(v):.1f}" '
                 'stroke="#ddd"/>')
    for x, label in marks:
        o.append(f'<line x1="{px(x):.1f}" y1="{top}" x2="{px(x):.1f}" y2="{h - bottom}" '
                 'stroke="#999" stroke-dasharray="4,3"/>')
        o.append(f'<text x="{px(x) + 3:.1f}" y="{top + 12}" fill="#666">{label}</text>')
    for k, (label, colour, s) in enumerate(series):
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(s))
        o.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        o.append(f'<text x="{w - right - 8}" y="{top + 16 + 16 * k}" text-anchor="end" '
                 f'fill="{colour}">{label}</text>')
    o.append("</svg>")
    return "\n".join(o) + "\n"
