#!/usr/bin/env python3
"""Runs every command block of README.md and docs/*.md, so the docs cannot go
stale: the commands a reader copies are the commands this test runs.

Each ```sh block runs in `bash -euo pipefail`, from the repository root, in
the order of the page, with HOME set to a scratch directory of that page (a
reader follows one page in one account: `make install PREFIX=$HOME/.local`
in one block is there for the next, and nothing of the machine's is
touched; cargo and rustup keep their homes, and the torch venv of
scripts/torch-venv.sh its place), under a time limit. The whole
process group is killed on time-out.

Other fenced blocks are checked, not run, through directives written as
HTML comments on the lines just before a block (invisible when rendered):

  <!-- doc: same-as PATH -->     the block's lines occur, in order and
                                 contiguously (indentation ignored), in PATH:
                                 a file that a build or another block
                                 compiles and runs (C, C++ and Rust examples)
  <!-- doc: not-run PREFIX: WHY --> lines of the next ```sh block that start
                                 with PREFIX are left out, for the reason
                                 given (only the test command itself, which
                                 CI runs anyway)

A ```rust, ```c or ```cpp block without `same-as` fails the check: every
snippet must be compiled by something. Blocks without a language (output,
synopses, diagrams) are not commands and are left alone.

Before the blocks, every repository path a page names in backticks
(`dir/file.rs`, `session/fast.rs`, `runtime/src/env/`) must name a file or
directory of the repository (the end of one's path), so that no page points
at code that moved. Paths of other projects are listed in EXTERNAL_PATHS.
And every table named by a `<!-- table: FILE#ID -->` directive must be what
scripts/doc-tables.py renders from its JSON.

Usage: scripts/doc-commands.py [--list] [--only SUBSTRING] [--timeout SECS]
Prints one line per block and ends with `doc-commands: N passed, N failed`.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*doc:\s*(same-as|not-run)\s+(.*?)\s*-->\s*$")
CHECKED_LANGS = {"rust", "c", "cpp"}
# a path in backticks: at least one slash, and a file name with an
# extension of ours or a trailing slash
PATH_REF = re.compile(
    r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*(?:\.(?:rs|py|sh|h|hpp|c|cpp|toml|md|json|svg|in)|/))`"
)
# paths in other projects' trees that the pages name on purpose
EXTERNAL_PATHS = {
    "test/parallel/test_torch.py",
    "test/single/test_torch_elastic.py",
    "examples/train_ddp.py",
}


def stale_paths(docs):
    """Every backticked path of `docs` that names nothing in the tree."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    names = set()
    for f in tracked:
        parts = f.split("/")
        for i in range(len(parts)):
            names.add("/".join(parts[i:]))
            if i + 1 < len(parts):
                # directories, with their trailing slash
                for j in range(i + 1, len(parts)):
                    names.add("/".join(parts[i:j]) + "/")
    out = []
    for d in docs:
        for n, line in enumerate(d.read_text().splitlines(), 1):
            for m in PATH_REF.finditer(line):
                p = m.group(1).removeprefix("./")
                if "/" not in p.rstrip("/"):
                    # one name (`docs/`, `target/`): not checked
                    continue
                if p in EXTERNAL_PATHS or p.startswith(("http", "/", "~")):
                    continue
                if p not in names:
                    out.append(f"{d.relative_to(ROOT)}:{n}: {p}")
    return out


class Block:
    def __init__(self, path, line, lang, text, directives):
        self.path, self.line, self.lang, self.text = path, line, lang, text
        self.directives = directives

    def where(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path):
    lines = path.read_text().splitlines()
    out, i, pending = [], 0, []
    while i < len(lines):
        d = DIRECTIVE.match(lines[i])
        if d:
            pending.append((d.group(1), d.group(2)))
            i += 1
            continue
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                pending = []
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        start = i + 1
        j = start
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        if j == len(lines):
            raise SystemExit(f"{path}:{i + 1}: unterminated code block")
        body = [l[len(indent):] if l.startswith(indent) else l for l in lines[start:j]]
        out.append(Block(path, i + 1, lang, "\n".join(body) + "\n", pending))
        pending = []
        i = j + 1
    return out


def occurs_in(snippet, path):
    """The snippet's non-empty lines, stripped, appear contiguously in path."""
    want = [l.strip() for l in snippet.splitlines() if l.strip()]
    have = [l.strip() for l in path.read_text().splitlines() if l.strip()]
    if not want:
        return True
    for k in range(len(have) - len(want) + 1):
        if have[k:k + len(want)] == want:
            return True
    return False


def check(block):
    """A checked (not run) block: returns an error string or None."""
    targets = [arg for kind, arg in block.directives if kind == "same-as"]
    if not targets:
        return f"a ```{block.lang} block needs <!-- doc: same-as PATH --> (a compiled copy)"
    for t in targets:
        p = ROOT / t
        if not p.is_file():
            return f"same-as {t}: no such file"
        if not occurs_in(block.text, p):
            return f"the block differs from {t} (it must occur there verbatim)"
    return None


def run(block, timeout, home):
    skip = []
    for kind, arg in block.directives:
        if kind == "not-run":
            prefix, _, why = arg.partition(":")
            if not why.strip():
                return f"not-run {prefix!r} gives no reason", ""
            skip.append(prefix.strip())
    script = "\n".join(
        l for l in block.text.splitlines() if not any(l.strip().startswith(p) for p in skip)
    )
    env = dict(os.environ)
    env.setdefault("CARGO_HOME", str(Path.home() / ".cargo"))
    env.setdefault("RUSTUP_HOME", str(Path.home() / ".rustup"))
    # the torch venv (scripts/torch-venv.sh) is a machine's cache too, like
    # cargo's: 5 GB not made again per page
    env.setdefault("KUNGFU_TORCH_VENV", str(Path.home() / ".cache" / "kungfu-torch-venv"))
    # and so is the compiled torch extension
    env.setdefault("KUNGFU_TORCH_BUILD_DIR", str(Path.home() / ".cache" / "kungfu" / "torch-ext"))
    env["HOME"] = str(home)
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return f"timed out after {timeout} s", out.decode(errors="replace")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the block
        except ProcessLookupError:
            pass
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        return f"exit status {proc.returncode}", text
    return None, text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the blocks, run nothing")
    ap.add_argument("--only", help="only blocks whose location or text contains this")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per block (1500)")
    args = ap.parse_args()

    docs = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    blocks = [b for d in docs for b in blocks_of(d)]
    homes = {}
    if args.only:
        blocks = [b for b in blocks if args.only in b.where() or args.only in b.text]
    passed = failed = 0
    if not args.list and not args.only:
        stale = stale_paths(docs)
        if stale:
            failed += 1
            print("FAIL paths named in the pages that are not in the tree:")
            print("".join(f"    | {l}\n" for l in stale), end="")
        else:
            passed += 1
            print("ok   every path the pages name is in the tree")
        # the tables from measurements: rendered from their JSON
        # (scripts/doc-tables.py), and the checker itself checked
        for extra in (["--self-test"], []):
            r = subprocess.run([sys.executable, str(ROOT / "scripts" / "doc-tables.py"), *extra],
                               cwd=ROOT, capture_output=True, text=True)
            last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
            if r.returncode == 0:
                passed += 1
                print(f"ok   {last}")
            else:
                failed += 1
                print(f"FAIL {last}")
                print("".join(f"    | {l}\n" for l in (r.stdout + r.stderr).splitlines()[-40:]), end="")
    for b in blocks:
        if b.lang not in CHECKED_LANGS and b.lang != "sh":
            continue
        if args.list:
            print(f"{b.where()}: ```{b.lang}")
            continue
        t0 = time.monotonic()
        if b.lang in CHECKED_LANGS:
            err, out = check(b), ""
        else:
            if b.path not in homes:
                homes[b.path] = Path(tempfile.mkdtemp(prefix="kungfu-doc-home-"))
            err, out = run(b, args.timeout, homes[b.path])
        secs = time.monotonic() - t0
        if err:
            failed += 1
            print(f"FAIL {b.where()} ({b.lang}, {secs:.0f} s): {err}")
            if out:
                print("".join(f"    | {l}\n" for l in out.splitlines()[-60:]), end="")
        else:
            passed += 1
            print(f"ok   {b.where()} ({b.lang}, {secs:.0f} s)")
        sys.stdout.flush()
    for h in homes.values():
        shutil.rmtree(h, ignore_errors=True)
    if not args.list:
        print(f"doc-commands: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
