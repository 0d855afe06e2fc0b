#!/bin/bash
# Times one allreduce size with several builds of kungfu-bench, alternating
# build by build in every round, and prints per build the min, first
# quartile and median time, and per later build how often it beat the first
# and the median of its per-round time ratios to it (<1: faster). For small
# sizes on a noisy machine, where compare.py's 20-iteration rows are too
# short.
#
#   benches/peers/alternate.sh SIZE ITERS ROUNDS DIR...
#
# Each DIR holds kungfu-run and kungfu-bench (a release build); 2 ranks,
# the default transport (shared memory on one host), allreduce, unless
# NP, TRANSPORT or OP say otherwise. Example:
#   benches/peers/alternate.sh 4 2000 41 /work/kf-bin/base target/release
#   NP=4 TRANSPORT=tcp OP=broadcast benches/peers/alternate.sh 1M 200 9 A B
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,15p' "$0"
    exit 2
fi
size=$1 iters=$2 rounds=$3
shift 3
np=${NP:-2} transport=${TRANSPORT:-auto} op=${OP:-allreduce}
for _ in $(seq "$rounds"); do
    for d in "$@"; do
        t=$(timeout 300 "$d/kungfu-run" -np "$np" --transport "$transport" "$d/kungfu-bench" "$op" -b "$size" -e "$size" \
            -n "$iters" -w 100 --in-place 0 2>&1 | awk '/\] +[0-9]/ {print $7}')
        echo "$d ${t:-nan}"
    done
done | python3 -c '
import statistics, sys
d = {}
for line in sys.stdin:
    k, v = line.split()
    d.setdefault(k, []).append(float(v))
for k, v in d.items():
    q = statistics.quantiles(v, n=4) if len(v) > 1 else v * 3
    print("%-30s n=%d min %.2f q25 %.2f median %.2f" % (k, len(v), min(v), q[0], statistics.median(v)))
ks = list(d)
for k in ks[1:]:
    wins = sum(x < y for x, y in zip(d[k], d[ks[0]]))
    r = statistics.median([x / y for x, y in zip(d[k], d[ks[0]])])
    print("%s faster than %s in %d of %d rounds; median of per-round time ratios %.2f" % (k, ks[0], wins, len(d[k]), r))
'
