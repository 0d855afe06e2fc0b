#!/usr/bin/env python3
"""Checks (or writes) the docs' tables against the JSON the benches wrote.

A table of README.md or docs/*.md that comes from a measurement is named by
a directive on the line before it:

    <!-- table: docs/bench/compare-default.json#allreduce-np2 -->

The table (the markdown lines that start with `|` right after it) must be
what benches/peers/tables.py renders from that table of that JSON file,
character for character: every number in it is the number the run wrote.

Usage:
    scripts/doc-tables.py            check every named table (exit 1 if one differs)
    scripts/doc-tables.py --write    render every named table into its page
    scripts/doc-tables.py --list     the named tables and their sources
    scripts/doc-tables.py --self-test  a page and a JSON made up here: the
                                     check passes, then fails on one digit
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benches" / "peers"))
from tables import render  # noqa: E402

DIRECTIVE = re.compile(r"^\s*<!--\s*table:\s*(\S+?)#(\S+)\s*-->\s*$")


def named_tables(page):
    """(line index of the directive, file, id, first and end line of its
    table) for every directive of `page`."""
    lines = page.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = DIRECTIVE.match(line)
        if not m:
            continue
        start = i + 1
        end = start
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        out.append((i, m.group(1), m.group(2), start, end))
    return lines, out


def table_of(file, id):
    path = ROOT / file
    if not path.is_file():
        raise LookupError(f"{file}: no such file")
    doc = json.loads(path.read_text())
    for t in doc.get("tables", []):
        if t.get("id") == id:
            return t
    raise LookupError(f"{file}: no table {id!r} (it has {[t.get('id') for t in doc.get('tables', [])]})")


def pages():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def where_of(page):
    return page.relative_to(ROOT)


def self_test():
    """The check, over a page and a JSON of a scratch directory: it passes
    as written, and fails once one digit of the page changes."""
    import tempfile
    global ROOT
    saved = ROOT
    with tempfile.TemporaryDirectory(prefix="kungfu-doc-tables-") as d:
        ROOT = Path(d)
        (ROOT / "docs").mkdir()
        doc = {"tables": [{"id": "t", "title": "", "command": None,
                           "columns": ["size", "GB/s", "ratio"], "formats": ["{}", "{:.3f}", "{:.2f}"],
                           "rows": [[1024, 1.23456, None], [4096, 2.5, 0.875]]}]}
        (ROOT / "docs" / "t.json").write_text(json.dumps(doc))
        page = ROOT / "README.md"
        page.write_text("# x\n\n<!-- table: docs/t.json#t -->\n| stale |\n\nafter\n")
        results = []
        for args, edit in [(["--write"], None), ([], None),
                           ([], lambda t: t.replace("2.500", "2.501")),
                           ([], lambda t: t.replace("docs/t.json#t", "docs/t.json#u"))]:
            if edit:
                page.write_text(edit(page.read_text()))
            sys.argv = ["doc-tables.py", *args]
            results.append(main())
        text = page.read_text()
    ROOT = saved
    want = [0, 0, 1, 1]
    ok = results == want and "| 1024 | 1.235 | - |" in text and text.endswith("after\n")
    print(f"doc-tables self-test: {'ok' if ok else 'FAILED'} (exit codes {results}, want {want})")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="render the tables into the pages")
    ap.add_argument("--list", action="store_true", help="list the named tables")
    ap.add_argument("--self-test", action="store_true", help="check the checker")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    bad = 0
    count = 0
    for page in pages():
        lines, named = named_tables(page)
        changed = False
        # from the last, so that a rewrite leaves the earlier indices valid
        for i, file, id, start, end in reversed(named):
            count += 1
            where = f"{where_of(page)}:{i + 1}"
            if a.list:
                print(f"{where}: {file}#{id}")
                continue
            try:
                want = render(table_of(file, id)).splitlines()
            except (LookupError, ValueError, KeyError) as e:
                print(f"FAIL {where}: {e}")
                bad += 1
                continue
            have = lines[start:end]
            if have == want:
                continue
            if a.write:
                lines[start:end] = want
                changed = True
                print(f"wrote {where}: {file}#{id}")
                continue
            bad += 1
            print(f"FAIL {where}: the table differs from {file}#{id}")
            for k in range(max(len(have), len(want))):
                h = have[k] if k < len(have) else "(none)"
                w = want[k] if k < len(want) else "(none)"
                if h != w:
                    print(f"    page: {h}\n    json: {w}")
                    break
        if changed:
            page.write_text("\n".join(lines) + "\n")
    if not a.list:
        print(f"doc-tables: {count} named tables, {bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
