"""The tables the bench scripts print and write as JSON, one format for all.

A bench script fills `Table`s (an id, a title, the command that made it,
columns, and rows of numbers and text) and writes them with `write_json`
next to its plots. A page of the docs shows a table by naming it in a
directive on the line before it:

    <!-- table: docs/bench/compare-default.json#allreduce-np2 -->

and `scripts/doc-tables.py` renders it from the JSON: `--check` (run in CI
by scripts/doc-commands.py) fails when a page's table differs from its JSON
by one character, `--write` puts the rendered tables into the pages. So a
number in a docs table is the number a run wrote, in the format its column
gives (`{:.3f}` and so on); a missing value is printed as `-`.
"""

import json
import math
import os
import platform
import sys
import time


class Table:
    def __init__(self, id, title, columns, formats, command=None):
        """`columns`: the headings; `formats`: one format string per column
        (`{}` for text and integers, `{:.2f}` for a ratio, ...)."""
        if len(columns) != len(formats):
            raise ValueError("one format per column")
        self.id, self.title, self.command = id, title, command
        self.columns, self.formats = list(columns), list(formats)
        self.rows = []

    def add(self, *cells):
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.id}: a row of {len(cells)} cells, {len(self.columns)} columns")
        self.rows.append([None if isinstance(c, float) and math.isnan(c) else c for c in cells])

    def to_json(self):
        return {"id": self.id, "title": self.title, "command": self.command,
                "columns": self.columns, "formats": self.formats, "rows": self.rows}


def cell(fmt, v):
    return "-" if v is None else fmt.format(v)


def render(t):
    """A table of the JSON (a dict, as `Table.to_json` makes) in markdown."""
    lines = ["| " + " | ".join(t["columns"]) + " |",
             "|" + "|".join("---" for _ in t["columns"]) + "|"]
    for row in t["rows"]:
        lines.append("| " + " | ".join(cell(f, v) for f, v in zip(t["formats"], row)) + " |")
    return "\n".join(lines)


def write_json(path, tables, **meta):
    """Writes `tables` to `path` with what made them: the command line, the
    date and the machine (cores, kernel), and any `meta` given."""
    doc = {
        "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        **meta,
        "tables": [t.to_json() for t in tables],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
