#!/usr/bin/env bash
# Runs Horovod's own PyTorch test suite (test/parallel/test_torch.py of a
# horovod checkout) against kungfu.torch, on CPU, with each number of
# processes given (default: 2 and 4), then its elastic tests
# (test/single/test_torch_elastic.py, one process):
#
#   scripts/horovod-suite.sh HOROVOD_SRC [NP...]
#
# The test file is run where it is, never copied: `import horovod.torch`
# resolves to kungfu.torch through python/tests/horovod_alias (first on
# PYTHONPATH), whose pytest plugin gives each rank the environment of
# `horovodrun --gloo` and records every test's outcome. Under kungfu-run
# every rank runs the same pytest (the same tests in the same order).
#
# Writes $HOROVOD_SUITE_OUT/elastic/log.txt (default target/horovod-suite)
# and, per NP, $HOROVOD_SUITE_OUT/np<NP>/:
# log.txt (every rank's pytest -v output), rank<R>.jsonl, and results.txt:
# one line per test (passed/failed/skipped, its group, the reason), then
# the counts. Exits non-zero if a test outside the GPU, process-set and
# Adasum groups failed (on any rank), if pytest collected nothing (its exit
# status 5) or did not finish on some rank.
#
# Environment: PYTHON (default: the venv of scripts/torch-venv.sh),
# KUNGFU_RUN (default target/release/kungfu-run, built if missing),
# HOROVOD_SUITE_TIMEOUT (the whole run per NP, default 60m),
# KUNGFU_HVD_TEST_TIMEOUT (seconds per test, default 600),
# HOROVOD_SUITE_PYTEST_ARGS (more pytest arguments, shell-quoted, e.g.
#   '-k "allreduce and not grad"'),
# KUNGFU_HVD_MODE=mpi (MPI-style environment instead of gloo's),
# KUNGFU_HVD_HIDE_MUON=0 (let the optimizer loops see torch.optim.Muon).
set -euo pipefail
if [ $# -lt 1 ]; then
  sed -n '2,8p' "$0" >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "$1" && pwd)
shift
nps=("$@")
[ ${#nps[@]} -gt 0 ] || nps=(2 4)
test_file="$src/test/parallel/test_torch.py"
if [ ! -f "$test_file" ]; then
  echo "horovod-suite: no $test_file (HOROVOD_SRC must hold a horovod checkout)" >&2
  exit 2
fi
py=${PYTHON:-}
[ -n "$py" ] || py="$("$repo/scripts/torch-venv.sh")/bin/python"
run=${KUNGFU_RUN:-$repo/target/release/kungfu-run}
if [ ! -x "$run" ]; then
  (cd "$repo" && cargo build --release --locked -q -p kungfu-tools --bin kungfu-run)
fi
alias_dir="$repo/python/tests/horovod_alias"
pp="$alias_dir"
# the source tree's kungfu when its library is built there, else the installed one
[ -f "$repo/python/kungfu/_lib/libkungfu.so" ] && pp="$pp:$repo/python"
export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}"
out=${HOROVOD_SUITE_OUT:-$repo/target/horovod-suite}
# the torch extension once, not by every rank at once
(cd / && "$py" -m kungfu.torch.build >/dev/null)
extra=()
[ -z "${HOROVOD_SUITE_PYTEST_ARGS:-}" ] || eval "extra=($HOROVOD_SUITE_PYTEST_ARGS)"
status=0
for np in "${nps[@]}"; do
  dir="$out/np$np"
  rm -rf "$dir"
  mkdir -p "$dir"
  echo "== horovod test_torch.py, $np processes (log: $dir/log.txt)"
  set +e
  # cwd: the results directory, so that no horovod source tree shadows the alias
  (cd "$dir" && KUNGFU_HVD_RESULTS="$dir" "$run" -np "$np" \
    --timeout "${HOROVOD_SUITE_TIMEOUT:-60m}" \
    "$py" -m pytest -v -p no:cacheprovider -p kungfu_hvd_plugin \
    "${extra[@]}" "$test_file") >"$dir/log.txt" 2>&1
  rc=$?
  set -e
  [ "$rc" = 0 ] || echo "horovod-suite: kungfu-run exited with $rc (a rank crashed or hung)" >&2
  if ! "$py" "$alias_dir/kungfu_hvd_summary.py" "$dir" "$np"; then
    status=1
  fi
  [ "$rc" = 0 ] || status=1
done
# Horovod's elastic API (test/single/test_torch_elastic.py): one process
# and no launcher, as Horovod's CI runs test/single
elastic_test="$src/test/single/test_torch_elastic.py"
if [ -f "$elastic_test" ]; then
  dir="$out/elastic"
  rm -rf "$dir"
  mkdir -p "$dir"
  echo "== horovod test_torch_elastic.py, 1 process (log: $dir/log.txt)"
  set +e
  (cd "$dir" && timeout --kill-after=10s 10m "$py" -m pytest -v -p no:cacheprovider \
    "$elastic_test") >"$dir/log.txt" 2>&1
  rc=$?
  set -e
  grep -E "(PASSED|FAILED|ERROR)|passed|failed" "$dir/log.txt" | tail -4
  [ "$rc" = 0 ] || { echo "horovod-suite: test_torch_elastic.py exited with $rc" >&2; status=1; }
fi
exit "$status"
