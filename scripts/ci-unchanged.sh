#!/usr/bin/env bash
# Lets scripts/test.sh skip a slow stage whose inputs have not changed since
# the stage last passed (Miri: minutes, over code that rarely changes).
#
#   scripts/ci-unchanged.sh NAME PATH...          exit 0 if PATH... (the files
#       git tracks under them, as they are in the work tree) and the
#       toolchains are what they were when NAME last passed, on this machine
#       or where the record in the repository was made; 1 if not, if NAME
#       never passed, or if KUNGFU_CI_FULL=1
#   scripts/ci-unchanged.sh --green NAME PATH...  records that NAME passed
#       on this machine
#   scripts/ci-unchanged.sh --record NAME PATH... records it in the
#       repository too (.ci/green/NAME, to commit): CI runs on a fresh
#       machine, which has no record of its own
#
# A record is a hash of the inputs and the toolchains: the machine's in
# ${XDG_CACHE_HOME:-~/.cache}/kungfu-ci/NAME, the repository's in
# .ci/green/NAME. Only a pass writes one (scripts/miri.sh --record after
# its runs passed), and any change to an input makes it stale.
set -euo pipefail
cd "$(dirname "$0")/.."
green=""
case "${1:-}" in
--green | --record)
  green=$1
  shift
  ;;
esac
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
  if [ "$green" = --record ]; then
    mkdir -p .ci/green
    echo "$now" > ".ci/green/$name"
  fi
  exit 0
fi
[ "${KUNGFU_CI_FULL:-0}" != 1 ] || exit 1
for record in "$dir/$name" ".ci/green/$name"; do
  if [ -f "$record" ] && [ "$(cat "$record")" = "$now" ]; then
    echo "(unchanged since it passed: record $record)"
    exit 0
  fi
done
exit 1
