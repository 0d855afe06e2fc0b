#!/usr/bin/env bash
# Lets scripts/test.sh skip a slow stage whose inputs have not changed since
# the stage last passed on this machine (Miri: minutes, over code that
# rarely changes).
#
#   scripts/ci-unchanged.sh NAME PATH...          exit 0 if PATH... (the files
#       git tracks under them, as they are in the work tree) and the
#       toolchains are what they were when NAME last passed here; 1 if not,
#       if NAME never passed here, or if KUNGFU_CI_FULL=1
#   scripts/ci-unchanged.sh --green NAME PATH...  records that NAME passed
#
# The record is a hash in ${XDG_CACHE_HOME:-~/.cache}/kungfu-ci/NAME: a
# fresh machine has none, so every stage runs there.
set -euo pipefail
cd "$(dirname "$0")/.."
green=""
if [ "${1:-}" = --green ]; then
  green=1
  shift
fi
name=$1
shift
dir="${XDG_CACHE_HOME:-$HOME/.cache}/kungfu-ci"
digest() {
  {
    rustc -V
    cargo +nightly -V 2>/dev/null || true
    git ls-files -z -- "$@" | sort -z | while IFS= read -r -d '' f; do
      [ -f "$f" ] && printf '%s %s\n' "$(git hash-object -- "$f")" "$f"
    done
  } | sha256sum | cut -d' ' -f1
}
now=$(digest "$@")
if [ -n "$green" ]; then
  mkdir -p "$dir"
  echo "$now" > "$dir/$name"
  exit 0
fi
[ "${KUNGFU_CI_FULL:-0}" != 1 ] || exit 1
[ -f "$dir/$name" ] && [ "$(cat "$dir/$name")" = "$now" ]
