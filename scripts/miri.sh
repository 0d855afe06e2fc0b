#!/usr/bin/env bash
# The unsafe code under Miri, where Miri can run it:
#   - the shared-memory ring (transport/src/shm/ring.rs) over a heap buffer:
#     scripts/miri-shm.sh (the SPSC protocol, futex wake-ups, hostile input;
#     each seed another schedule of the two threads);
#   - the C ABI layer's runtime-free code (ffi/src): scripts/miri-ffi.sh
#     (handles, completions, unaligned output, per-thread state).
#
#   scripts/miri.sh            # everything, with the scripts' own seed counts
#   scripts/miri.sh --quick    # fewer seeds (what scripts/test.sh runs in CI)
#   scripts/miri.sh --quick --record
#                              # and, if it passed, records so in .ci/green/miri
#                              # (commit it: CI skips Miri while its inputs,
#                              # listed by --inputs, and the toolchains are
#                              # the same; scripts/ci-unchanged.sh)
#   scripts/miri.sh --inputs   # the files whose change makes it run again
#
# Installs Miri into the nightly toolchain if it is missing. The first run
# builds Miri's sysroot and the dependencies (about 5 minutes on 2 cores),
# later runs take about a minute (--quick) to two.
set -euo pipefail
cd "$(dirname "$0")/.."
inputs=(transport/src ffi/src scripts/miri.sh scripts/miri-shm.sh scripts/miri-region.sh scripts/miri-ffi.sh Cargo.lock)
if [ "${1:-}" = --inputs ]; then
  printf '%s\n' "${inputs[@]}"
  exit 0
fi
quick="" record=""
for a in "$@"; do
  case "$a" in
  --quick) quick=1 ;;
  --record) record=1 ;;
  *)
    echo "miri.sh: unknown argument $a (--quick, --record, --inputs)" >&2
    exit 2
    ;;
  esac
done
if ! cargo +nightly miri --version >/dev/null 2>&1; then
  echo "== installing Miri (rustup component add miri rust-src --toolchain nightly)"
  rustup toolchain install nightly --profile minimal --component miri,rust-src
fi
if [ -n "$quick" ]; then
  export MIRI_SEEDS="${MIRI_SEEDS:-0..4}" MIRI_FFI_SEEDS="${MIRI_FFI_SEEDS:-0..8}"
fi
scripts/miri-shm.sh
scripts/miri-region.sh
scripts/miri-ffi.sh
if [ -n "$record" ]; then
  scripts/ci-unchanged.sh --record miri "${inputs[@]}"
  echo "miri.sh: passed; recorded in .ci/green/miri"
fi
