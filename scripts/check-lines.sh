#!/usr/bin/env bash
# The house's bounds on file length:
# - no tracked source file (Rust, C, C++, Python, shell) over 800 lines;
# - at most 5 library files (Rust under a crate's src/, tests and generated
#   bindings aside) over 600 lines, each saying why in its first 10 lines
#   (a comment with "over 600 lines").
# A file past them usually holds more than one responsibility and is split
# along its seams (docs/design.md describes the layers).
#   scripts/check-lines.sh [LIMIT]   (default 800; the library bound is 600)
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${1:-800}
lib_limit=600
lib_most=5
# "FILE LINES" of every tracked file of the pathspecs over LIMIT lines
over() {
  local limit=$1
  shift
  git ls-files "$@" | while read -r f; do
    [ -f "$f" ] || continue
    n=$(wc -l < "$f")
    [ "$n" -le "$limit" ] || echo "$f $n"
  done
}
# generated code is exempt (fabric-sys/src/bindings.rs: bindgen's output;
# ffi/include/kungfu.h: cbindgen's, from ffi/src, where the bounds apply)
over=$(over "$limit" '*.rs' '*.c' '*.cpp' '*.h' '*.py' '*.sh' ':(exclude)fabric-sys/src/bindings.rs' ':(exclude)ffi/include/kungfu.h')
status=0
if [ -n "$over" ]; then
  echo "check-lines: source files over $limit lines:"
  echo "$over" | sed 's/^/  /; s/ \([0-9]*\)$/: \1 lines/'
  status=1
fi
# library files: under a crate's src/, not a test module, not tests/'s crate
lib_over=$(over "$lib_limit" '*/src/*.rs' ':(exclude)fabric-sys/src/bindings.rs' ':(exclude)tests/*' \
  ':(exclude)*/tests.rs' ':(exclude)*/tests/*')
count=0
while read -r f n; do
  [ -n "$f" ] || continue
  count=$((count + 1))
  if ! head -n 10 "$f" | grep -qi "over $lib_limit lines"; then
    echo "check-lines: $f has $n lines and no reason in its first 10 lines (a comment saying why it is over $lib_limit lines)"
    status=1
  fi
done <<<"$lib_over"
if [ "$count" -gt "$lib_most" ]; then
  echo "check-lines: $count library files over $lib_limit lines; at most $lib_most:"
  echo "$lib_over" | sed 's/^/  /'
  status=1
fi
[ "$status" = 0 ] && echo "check-lines: no source file over $limit lines; $count library files over $lib_limit (at most $lib_most, each with its reason)"
exit $status
