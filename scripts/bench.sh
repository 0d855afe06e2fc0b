#!/usr/bin/env bash
# The main job: builds in release and runs a 4-worker allreduce sweep through
# kungfu-run, printing the nccl-tests-style table. Extra arguments go to
# kungfu-bench (e.g. `scripts/bench.sh -e 16M -d half`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p kungfu-tools --bins
exec target/release/kungfu-run -np 4 --timeout 10m \
  target/release/kungfu-bench allreduce -b 1K -e 64M -f 4 -n 20 -w 5 -c 1 "$@"
