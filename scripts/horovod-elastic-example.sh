#!/usr/bin/env bash
# Runs Horovod's elastic PyTorch example
# (examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py of a
# horovod checkout) with only its import changed (`import kungfu.torch as
# hvd`), under `kungfu-run -w --on-failure shrink -np 3`, and SIGKILLs one
# worker once the benchmark has run an iteration:
#
#   scripts/horovod-elastic-example.sh HOROVOD_SRC
#
# The changed copy is written to a temporary directory, never into this
# repository. Passes if the job ends with status 0, the survivors
# recovered (the run goes on past the kill) and rank 0 printed the
# example's result ("Total img/sec on N CPU(s)").
#
# The example needs torchvision (its models): where the venv has none,
# torchvision is installed without its dependencies (it must not replace
# torch), with pillow, into target/horovod-example/site, on PYTHONPATH for this run
# only; its compiled ops may not match the venv's torch (the models do
# not need them). Environment: PYTHON (default: the venv of
# scripts/torch-venv.sh), EXAMPLE_ARGS (default: a small resnet18 run).
set -euo pipefail
if [ $# -ne 1 ]; then
  sed -n '2,8p' "$0" >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "$1" && pwd)
example="$src/examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py"
[ -f "$example" ] || { echo "horovod-elastic-example: no $example" >&2; exit 2; }
py=${PYTHON:-}
[ -n "$py" ] || py="$("$repo/scripts/torch-venv.sh")/bin/python"
run="$repo/target/release/kungfu-run"
[ -x "$run" ] || (cd "$repo" && cargo build --release --locked -q -p kungfu-tools --bin kungfu-run)
out="$repo/target/horovod-example"
mkdir -p "$out"
if ! "$py" -c 'import torchvision' 2>/dev/null; then
  if ! PYTHONPATH="$out/site" "$py" -c 'import torchvision' 2>/dev/null; then
    "$py" -m pip install -q --no-deps --target "$out/site" torchvision pillow
  fi
  export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"; [ -z "${job:-}" ] || kill -- "-$job" 2>/dev/null || true' EXIT
sed 's/^import horovod\.torch as hvd$/import kungfu.torch as hvd/' "$example" >"$work/example.py"
changed=$(diff "$example" "$work/example.py" | grep -c '^>' || true)
[ "$changed" = 1 ] || { echo "horovod-elastic-example: the import line was not found once" >&2; exit 2; }
log="$out/log.txt"
args=${EXAMPLE_ARGS:---no-cuda --model resnet18 --batch-size 4 --num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 8}
echo "== horovod's pytorch_synthetic_benchmark_elastic.py under kungfu-run -w -np 3 (log: $log)"
: >"$log"
# shellcheck disable=SC2086  # the example's arguments, split
setsid "$run" -w --on-failure shrink -np 3 --timeout 10m \
  "$py" "$work/example.py" $args >"$log" 2>&1 &
job=$!
# once an iteration has run, kill the worker of rank 2 (its pid: the
# launcher's child whose environment says KUNGFU_RANK=2)
deadline=$((SECONDS + 300))
until grep -aq "Iter #1" "$log"; do
  kill -0 "$job" 2>/dev/null || break
  [ $SECONDS -lt $deadline ] || { echo "horovod-elastic-example: no iteration in 300 s" >&2; exit 1; }
  sleep 0.5
done
victim=""
for p in $(pgrep -P "$job" || true); do
  if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx 'KUNGFU_RANK=2'; then victim=$p; fi
done
[ -n "$victim" ] || { echo "horovod-elastic-example: no worker of rank 2 to kill" >&2; exit 1; }
echo "killing rank 2 (pid $victim) after: $(grep -a "Iter #" "$log" | tail -1)"
kill -9 "$victim"
set +e
wait "$job"
rc=$?
set -e
job=""
grep -aE "Iter #|Total img/sec|kungfu-run: " "$log" | tail -20
if [ "$rc" != 0 ] || ! grep -aq "Total img/sec on" "$log"; then
  echo "horovod-elastic-example: failed (kungfu-run exited with $rc; log: $log)" >&2
  exit 1
fi
echo "horovod-elastic-example: passed (one worker killed mid-run; the job finished)"
