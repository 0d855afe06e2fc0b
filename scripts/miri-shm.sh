#!/usr/bin/env bash
# Runs the shared-memory ring's tests (transport/src/shm/ring/tests.rs),
# and the lanes' and door bells' beside it (shm/lane/tests.rs, shm/bell.rs),
# under Miri: the SPSC protocol between two threads, wake-ups through the
# futex, and the hostile-input cases (corrupt indices, headers and
# lengths), over a heap buffer, since Miri cannot map files. Miri reports
# any access outside the buffer, any data race, and, with its weak-memory
# emulation, orderings that are too weak; each seed is another schedule of
# the two threads.
#
#   scripts/miri-shm.sh            # seeds 0..16 (about 45 s here once built)
#   MIRI_SEEDS=0..64 scripts/miri-shm.sh
#
# Needs a nightly toolchain with Miri:
#   rustup toolchain install nightly --component miri
# The first run builds Miri's sysroot and the crate's dependencies (a few
# minutes); later runs only the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
seeds="${MIRI_SEEDS:-0..16}"
export MIRIFLAGS="${MIRIFLAGS:-} -Zmiri-many-seeds=${seeds}"
echo "== miri: the shm ring, lanes and bells, seeds ${seeds}"
exec cargo +nightly miri test -p kungfu-transport --lib -- shm::ring shm::lane shm::bell
