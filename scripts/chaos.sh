#!/usr/bin/env bash
# A long soak of the launcher's chaos test (tools/tests/launcher/chaos.rs):
# a 4-worker kungfu-selftest training loop under `kungfu-run --on-failure
# replace` over TCP while a seeded driver kills, freezes, pauses and delays
# workers, drops their connections and throws garbage at their ports, for
# CHAOS_SECS (default 1800,
# CI runs 30), niced. Not for CI. It ends with the counts (injected,
# detected, survived), the detection times after SIGKILL and SIGSTOP and the
# recovery time to the first good step; it fails on a wrong value, a hang,
# or survivors whose models differ.
#
#   scripts/chaos.sh                              # 30 minutes, a seed from the clock
#   CHAOS_SECS=7200 CHAOS_SEED=42 scripts/chaos.sh
#   CHAOS_FAULTS=kill,freeze scripts/chaos.sh     # only these kinds
#   CHAOS_LOG=chaos.log scripts/chaos.sh          # every line but the good steps
set -euo pipefail
cd "$(dirname "$0")/.."
export CHAOS_SECS=${CHAOS_SECS:-1800}
export CHAOS_SEED=${CHAOS_SEED:-$(date +%s%N)}
echo "chaos.sh: ${CHAOS_SECS}s, CHAOS_SEED=$CHAOS_SEED${CHAOS_FAULTS:+, CHAOS_FAULTS=$CHAOS_FAULTS}"
nice -n 10 cargo test -p kungfu-tools --test launcher chaos_training -- --nocapture
