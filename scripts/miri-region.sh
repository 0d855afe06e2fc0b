#!/usr/bin/env bash
# Miri over transport/src/region.rs: the share table that every raw
# pointer into op memory goes through (aliasing, release-after-last-share,
# threads writing disjoint shares). Seeds: MIRI_SEEDS (default 0..16).
set -euo pipefail
cd "$(dirname "$0")/.."
seeds="${MIRI_SEEDS:-0..16}"
export MIRIFLAGS="${MIRIFLAGS:-} -Zmiri-many-seeds=${seeds}"
echo "== miri: op memory regions, seeds ${seeds}"
exec cargo +nightly miri test -p kungfu-transport --lib region::
