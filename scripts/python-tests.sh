#!/usr/bin/env bash
# The Python package and its torch tests: makes (or reuses) the torch venv
# (scripts/torch-venv.sh), installs ./python into it as a user would
# (`pip install ./python` builds and bundles libkungfu), builds the torch
# extension, and runs python/tests under pytest with kungfu-run. Extra
# arguments go to pytest (e.g. `-k ddp`).
#
# Horovod's own test suite (test/parallel/test_torch.py of horovod/horovod)
# is not part of this repository: with HOROVOD_SRC=<a horovod checkout>
# set, scripts/horovod-suite.sh runs it against kungfu.torch afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
# libkungfu and kungfu-run (and the other tools, which the docs' commands
# run next in scripts/test.sh) in one cargo call, so that they compile side
# by side; the package's install below finds libkungfu built
echo "== libkungfu and kungfu-run (cargo build --release -p kungfu-ffi -p kungfu-tools)"
cargo build --release --locked -q -p kungfu-ffi -p kungfu-tools
venv=$(scripts/torch-venv.sh --install)
py="$venv/bin/python"
export KUNGFU_RUN="$PWD/target/release/kungfu-run"
echo "== pytest python/tests"
set +e
(cd python/tests && "$py" -m pytest -q -p no:cacheprovider "$@")
rc=$?
set -e
# 5: pytest collected no test (a filter matched none): that is a failure
# here, said as such, not a pass
if [ "$rc" = 5 ]; then
  echo "python-tests: pytest collected no tests${*:+ for: $*}" >&2
  exit 1
fi
[ "$rc" = 0 ] || exit "$rc"
if [ -n "${HOROVOD_SRC:-}" ]; then
  scripts/horovod-suite.sh "$HOROVOD_SRC"
fi
