#!/usr/bin/env bash
# Fails if a tracked source file (Rust, C, C++, Python, shell) is longer
# than the house limit: a file past it holds more than one responsibility
# and is split along its seams (docs/design.md describes the layers).
#   scripts/check-lines.sh [LIMIT]   (default 800)
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${1:-800}
# generated code is exempt (fabric-sys/src/bindings.rs: bindgen's output)
over=$(git ls-files '*.rs' '*.c' '*.cpp' '*.h' '*.py' '*.sh' ':(exclude)fabric-sys/src/bindings.rs' \
  | while read -r f; do
      [ -f "$f" ] || continue
      n=$(wc -l < "$f")
      [ "$n" -gt "$limit" ] && echo "  $f: $n lines"
    done || true)
if [ -n "$over" ]; then
  echo "check-lines: source files over $limit lines:"
  echo "$over"
  exit 1
fi
echo "check-lines: no source file over $limit lines"
