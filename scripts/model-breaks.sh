#!/usr/bin/env bash
# Shows that the recovery's model checks (runtime/tests/model_recover.rs)
# rest on the real code: each break below takes one safeguard out of the
# real code, in a scratch copy of the tree, and the model checks must then
# fail (the variants that must fail are skipped: they fail anyway).
#
#   cas       store::compare_and_set takes every version
#             (runtime/src/store/mod.rs)
#   barrier   the recovery machine goes from connected to adopt without
#             asking for the barrier (runtime/src/recover/machine.rs)
#
#   scripts/model-breaks.sh            # both
#   scripts/model-breaks.sh barrier    # one
#
# Exits 0 when every break made the checks fail, 1 when one did not. Not
# for CI (each break rebuilds the runtime crate and runs the checks: a few
# minutes). The scratch copy builds in a target dir of its own,
# target/model-breaks, kept for the next run: cargo names a workspace
# crate's build by its path within the workspace, so the broken copy
# sharing target/ would replace the tree's own builds with broken ones.
# The scratch copy is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
breaks=("$@")
[ ${#breaks[@]} -gt 0 ] || breaks=(cas barrier)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/kungfu-model-breaks.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/model-breaks

# break FILE OLD NEW: replace the one occurrence of OLD in FILE by NEW
break_in() {
  python3 - "$1" "$2" "$3" <<'EOF'
import sys
path, old, new = sys.argv[1:]
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f"model-breaks: {path}: the code to break is not there once (has it changed?): {old!r}")
open(path, "w").write(s.replace(old, new))
EOF
}

failed=0
for b in "${breaks[@]}"; do
  rm -rf "$scratch/tree"
  mkdir -p "$scratch/tree"
  git ls-files -z | (cd "$root" && xargs -0 cp --parents -t "$scratch/tree")
  case "$b" in
    cas)
      break_in "$scratch/tree/runtime/src/store/mod.rs" \
        "        Some(next) if given == next => Ok(())," \
        "        Some(_) => Ok(()),
        #[allow(unreachable_patterns)]
        Some(next) if given == next => Ok(()),"
      ;;
    barrier)
      break_in "$scratch/tree/runtime/src/recover/machine.rs" \
        "n.stage = if old { Stage::Connected } else { Stage::Passed };" \
        "n.stage = if old { Stage::Passed } else { Stage::Passed };"
      ;;
    *) echo "model-breaks: no break named $b (cas, barrier)" >&2; exit 2 ;;
  esac
  echo "model-breaks: $b: running the model checks on the broken copy"
  log="$scratch/$b.log"
  if (cd "$scratch/tree" && CARGO_TARGET_DIR="$target" cargo test -q -p kungfu --test model_recover \
      -- --skip without_ --test-threads 1) >"$log" 2>&1; then
    echo "model-breaks: $b: the checks PASSED on the broken code: they do not rest on it"
    failed=1
  else
    grep -q "test result: FAILED" "$log" || { cat "$log"; echo "model-breaks: $b: the build or run failed"; exit 1; }
    echo "model-breaks: $b: the checks failed, as they must:"
    sed -n -E 's/^---- (.*) stdout ----$/  failed: \1/p; s/^.*(Unexpected "[^"]*").*$/    \1/p' "$log" | head -12
  fi
done
exit $failed
