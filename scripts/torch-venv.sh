#!/usr/bin/env bash
# Prints the path of a virtual environment with the pinned torch (CPU use)
# and the Python tests' packages, making it only if it is missing or holds
# another torch: `${KUNGFU_TORCH_VENV:-~/.cache/kungfu-torch-venv}`, kept
# between runs (torch is about 5 GB). Progress goes to stderr.
#
#   scripts/torch-venv.sh             make or reuse it; print its path
#   scripts/torch-venv.sh --install   also `pip install ./python` into it
#                                     (builds libkungfu and bundles it)
#                                     and build the torch extension
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.15.0
venv="${KUNGFU_TORCH_VENV:-$HOME/.cache/kungfu-torch-venv}"
py="$venv/bin/python"
have=$("$py" -c 'import torch, pytest, numpy; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$TORCH_VERSION" ]; then
  if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    ver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    scripts/apt-need.sh "python$ver-venv" >&2
  fi
  echo "== making $venv with torch==$TORCH_VERSION (once; about 5 GB)" >&2
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip >&2
  "$py" -m pip install -q "torch==$TORCH_VERSION" pytest numpy >&2
fi
if [ "${1:-}" = --install ]; then
  # What the package is made of: libkungfu as cargo builds it now, kungfu.h
  # and the package's files. The same again (one run of the test suite
  # installs three times: its tests and two pages of docs) is not
  # installed again.
  echo "== libkungfu (cargo build --release -p kungfu-ffi)" >&2
  cargo build --release --locked -q -p kungfu-ffi >&2
  lib="$(cargo metadata --format-version 1 --no-deps |
    "$py" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/libkungfu.so"
  # (outside a git clone there is no list of the package's files: it is
  # installed every time)
  made_of=$({
    sha256sum "$lib" ffi/include/kungfu.h
    git ls-files -z -- python ':!python/tests' | xargs -0 sha256sum
  } 2>/dev/null | sha256sum | cut -c1-32) || made_of=""
  stamp="$venv/.kungfu-installed"
  if [ -n "$made_of" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$made_of" ]; then
    echo "== ./python is installed in $venv as it is here" >&2
  else
    echo "== pip install ./python (into $venv)" >&2
    rm -f "$stamp"
    KUNGFU_LIB="$lib" "$py" -m pip install -q ./python >&2
    echo "$made_of" >"$stamp"
  fi
  echo "== the torch extension (python -m kungfu.torch.build)" >&2
  (cd / && "$py" -m kungfu.torch.build) >&2
fi
echo "$venv"
