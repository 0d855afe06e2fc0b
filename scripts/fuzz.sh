#!/usr/bin/env bash
# Runs every fuzz target of fuzz/ for SECONDS each (default 60), one after
# another, niced, with the limits the targets were run with (docs/fuzzing.md);
# new inputs go into fuzz/corpus/TARGET, crashes into fuzz/artifacts/TARGET.
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
# Long runs belong here, not in CI: CI replays the committed corpus on
# stable (tests/tests/suite/fuzz_corpus.rs).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#   scripts/fuzz.sh 600 http      # one target, ten minutes
# After a run: `cargo +nightly fuzz cmin TARGET` (in fuzz/) before committing
# the corpus.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(header handshake http cluster_config rendezvous etcd_response)
fi
status=0
for t in "${targets[@]}"; do
    # http: a head of up to 8 KiB and a body after it; etcd_response: a head
    # of up to 16 KiB
    max_len=4096
    [ "$t" = http ] && max_len=16384
    [ "$t" = etcd_response ] && max_len=32768
    echo "== $t: ${secs}s"
    if ! nice -n 19 cargo +nightly fuzz run -O "$t" -- \
        -max_total_time="$secs" -rss_limit_mb=512 -malloc_limit_mb=256 \
        -max_len="$max_len" -timeout=10 -print_final_stats=1; then
        echo "== $t: FOUND SOMETHING (see fuzz/artifacts/$t)"
        status=1
    fi
done
exit $status
