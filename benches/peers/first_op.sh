#!/bin/bash
# The first op of a size against its steady state: per build, the time of
# a 1 KiB allreduce (20 timed ops after 5 warm-up ops, out of place,
# unchecked) when it is the sweep's only size ("first") and when 256 and
# 512 B come before it ("later"), builds alternating in every round; prints
# per build the medians, the slowest first, the ratio of the medians and
# how many rounds' first was over twice the later median.
#
#   benches/peers/first_op.sh NP ROUNDS DIR...
#
# Each DIR holds kungfu-run and kungfu-bench (a release build). Example:
#   benches/peers/first_op.sh 4 8 /work/kf-bin/base target/release
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,11p' "$0"
    exit 2
fi
np=$1 rounds=$2
shift 2
time_1k() {
    local d=$1 from=$2
    timeout 300 "$d/kungfu-run" -np "$np" "$d/kungfu-bench" allreduce -b "$from" -e 1K -f 2 \
        -n 20 -w 5 -c 0 --in-place 0 2>&1 | awk '/\] +1024 / {print $7}'
}
for _ in $(seq "$rounds"); do
    for d in "$@"; do
        first=$(time_1k "$d" 1K)
        later=$(time_1k "$d" 256)
        echo "$d ${first:-nan} ${later:-nan}"
    done
done | python3 -c '
import statistics, sys
runs = {}
for line in sys.stdin:
    d, first, later = line.split()
    runs.setdefault(d, []).append((float(first), float(later)))
print(f"# np '"$np"', 1 KiB allreduce, us per op over {len(next(iter(runs.values())))} rounds")
print("build | first: median, max | later: median | first/later: median-ratio, runs over 2x")
for d, r in runs.items():
    f = statistics.median(x for x, _ in r)
    l = statistics.median(y for _, y in r)
    over = sum(x > 2 * l for x, _ in r)
    print(f"{d} | {f:.1f} {max(x for x, _ in r):.1f} | {l:.1f} | {f / l:.2f} {over}")
'
