#!/usr/bin/env bash
# Runs PyTorch's own fault-tolerance suite for process groups
# (test/distributed/test_c10d_fault_tolerance.py of a pytorch checkout or
# snapshot) with ("kungfu", "cpu") added to its FAULT_TOLERANCE_BACKENDS,
# beside gloo, and checks that every test gloo passes, kungfu passes too:
#
#   scripts/torch-ft-suite.sh PYTORCH_SRC
#
# The suite is not part of this repository: the patched copy (the backend
# added to the list, and `import kungfu.torch` so that the test's spawned
# processes have the backend) is written to a temporary directory and
# removed afterwards. The suite needs the `expecttest` package, which is
# installed into the venv if it is missing.
#
# Writes $TORCH_FT_SUITE_OUT (default target/torch-ft-suite): log.txt
# (pytest -v), junit.xml and results.txt (one line per test, then the
# counts). Exits non-zero if a kungfu test failed, if a test that gloo
# passes did not pass for kungfu, or if pytest ran no kungfu test.
#
# Environment: PYTHON (default: the venv of scripts/torch-venv.sh, with
# this repository's package installed by `scripts/torch-venv.sh
# --install`), TORCH_FT_SUITE_TIMEOUT (the whole run, default 20m),
# TORCH_FT_SUITE_PYTEST_ARGS (more pytest arguments, shell-quoted, e.g.
# '-k Kungfu').
set -euo pipefail
if [ $# -ne 1 ]; then
  sed -n '2,8p' "$0" >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "$1" && pwd)
test_file="$src/test/distributed/test_c10d_fault_tolerance.py"
if [ ! -f "$test_file" ]; then
  echo "torch-ft-suite: no $test_file (PYTORCH_SRC must hold a pytorch checkout)" >&2
  exit 2
fi
py=${PYTHON:-}
[ -n "$py" ] || py="$("$repo/scripts/torch-venv.sh")/bin/python"
"$py" -c 'import expecttest' 2>/dev/null || "$py" -m pip install -q expecttest
# the torch extension once, not by every process of every test at once
(cd / && "$py" -m kungfu.torch.build >/dev/null)
out=${TORCH_FT_SUITE_OUT:-$repo/target/torch-ft-suite}
rm -rf "$out"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" - "$test_file" "$work/test_c10d_fault_tolerance.py" <<'EOF'
import sys

src, dst = sys.argv[1], sys.argv[2]
text = open(src).read()
anchor = "FAULT_TOLERANCE_BACKENDS = [\n"
if text.count(anchor) != 1:
    sys.exit(f"torch-ft-suite: {src} has no single {anchor.strip()!r} to add kungfu to")
text = text.replace(anchor, anchor + '    ("kungfu", "cpu"),\n', 1)
# first, so that the processes each test spawns register the backend too
text = "import kungfu.torch  # the 'kungfu' backend\n" + text
open(dst, "w").write(text)
EOF
extra=()
[ -z "${TORCH_FT_SUITE_PYTEST_ARGS:-}" ] || eval "extra=($TORCH_FT_SUITE_PYTEST_ARGS)"
echo "== pytorch's test_c10d_fault_tolerance.py with kungfu added (log: $out/log.txt)"
set +e
(cd "$work" && timeout --kill-after=30s "${TORCH_FT_SUITE_TIMEOUT:-20m}" \
  "$py" -m pytest -v -p no:cacheprovider --junitxml="$out/junit.xml" \
  "${extra[@]}" test_c10d_fault_tolerance.py) >"$out/log.txt" 2>&1
rc=$?
set -e
echo "(pytest exited with $rc)"
"$py" - "$out" <<'EOF'
import sys
import xml.etree.ElementTree as ET

out = sys.argv[1]
try:
    root = ET.parse(f"{out}/junit.xml").getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"torch-ft-suite: no results ({e}); see {out}/log.txt")
results = {}
for case in root.iter("testcase"):
    cls = case.get("classname", "").rsplit(".", 1)[-1]
    outcome = "passed"
    for child in case:
        if child.tag in ("failure", "error"):
            outcome = "failed"
        elif child.tag == "skipped":
            outcome = "skipped"
    results[(cls, case.get("name"))] = outcome
lines, bad = [], []
for (cls, name), outcome in sorted(results.items()):
    lines.append(f"{outcome:8} {cls}.{name}")
    if cls == "KungfuFaultToleranceTest" and outcome == "failed":
        bad.append(f"{name}: failed")
    if cls == "GlooFaultToleranceTest" and outcome == "passed":
        mine = results.get(("KungfuFaultToleranceTest", name))
        if mine != "passed":
            bad.append(f"{name}: gloo passes it, kungfu {mine or 'did not run it'}")
count = {}
for (cls, _), outcome in results.items():
    count.setdefault(cls, {}).setdefault(outcome, 0)
    count[cls][outcome] += 1
for cls, c in sorted(count.items()):
    lines.append(f"{cls}: " + ", ".join(f"{n} {o}" for o, n in sorted(c.items())))
text = "\n".join(lines) + "\n"
open(f"{out}/results.txt", "w").write(text)
print(text, end="")
if not count.get("KungfuFaultToleranceTest", {}).get("passed"):
    bad.append("no kungfu test passed")
if bad:
    print("torch-ft-suite: " + "; ".join(bad), file=sys.stderr)
    sys.exit(1)
print("torch-ft-suite: every test gloo passes, kungfu passes")
EOF
