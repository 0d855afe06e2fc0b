#!/usr/bin/env bash
# The C ABI layer (ffi/src) under Miri: the unit tests that need no
# runtime (handle table, completions and their callbacks, output delivery
# into unaligned buffers, groups, argument checks, per-thread last errors,
# the panic guard, the adaptation helpers' list and norm code). Miri checks
# their raw-pointer work (alignment, bounds, Stacked Borrows) and, across
# many schedules, that the hand-over from a library thread to a waiting
# caller is free of data races.
#
# Not under Miri: anything that starts the runtime (tokio's IO driver,
# sockets, shared memory, fork), i.e. every op that reaches a peer; those
# are covered by ffi/tests/*.rs with real processes.
#
# Takes about 4 minutes from cold (Miri builds the dependencies once,
# under target/miri) and under a minute after.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly miri --version >/dev/null 2>&1; then
  rustup toolchain install nightly --component miri
fi

echo "== miri: kungfu-ffi unit tests"
cargo +nightly miri test -p kungfu-ffi --lib

# The tests with threads again, under 32 schedules each: a race that
# one schedule misses shows up in another.
echo "== miri: kungfu-ffi thread tests, seeds ${MIRI_FFI_SEEDS:-0..32}"
MIRIFLAGS="${MIRIFLAGS:-} -Zmiri-many-seeds=${MIRI_FFI_SEEDS:-0..32}" \
  cargo +nightly miri test -p kungfu-ffi --lib -- \
  output_and_callback_of_another_thread the_last_error_is_per_thread \
  groups_hold_this_threads_allreduces
