#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine with Rust installed:
# installs the system packages the tests need, then checks formatting,
# lints and docs, runs every test, builds and smoke-runs the benches, and
# runs the unsafe code that Miri can run under Miri, the Python package's
# torch tests (scripts/python-tests.sh), and every command block of
# README.md and docs/ (scripts/doc-commands.py).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage's time, printed at the end (also when a stage fails), so that a
# slower CI shows where it went.
stage_log=()
stage_t0=$SECONDS
stage_name=""
stage() {
  local now=$SECONDS
  [ -z "$stage_name" ] || stage_log+=("$(printf '%6ds  %s' $((now - stage_t0)) "$stage_name")")
  stage_name="$1"
  stage_t0=$now
  [ -z "$1" ] || echo "== $1"
}
stage_times() {
  local rc=$?
  # (a venv cut off half made is made again by the next run)
  [ -z "${venv_pid:-}" ] || kill -- "-$venv_pid" 2>/dev/null || true
  rm -f "${venv_log:-}"
  stage ""
  echo "== time per stage (rc=$rc)"
  printf '%s\n' "${stage_log[@]}"
  printf '%6ds  total\n' "$SECONDS"
}
trap stage_times EXIT

# The build cache. CI runs this on a fresh clone each time: without a cache
# it compiles every dependency again in each profile (about ten of its
# minutes), and cargo tells packages of the workspace apart by their path,
# so a clone at another path compiles the whole workspace again (about ten
# more). A clone that has no target/ yet is therefore copied (its work
# tree and .git, as they are) to a fixed place beside the cache,
# ${KUNGFU_BUILD_CACHE:-~/.cache/kungfu-ci/target}/../src, and the suite
# runs there, on the cache's target/: files the same as last time are not
# compiled again (cargo compares their contents). KUNGFU_BUILD_CACHE=off:
# a plain target/ in the clone. A work tree with its own target/ is left
# alone. The cache is dropped when it outgrows KUNGFU_BUILD_CACHE_GB (30)
# or the disk has less than 10 GiB free, and one run at a time uses it.
cache="${KUNGFU_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kungfu-ci/target}"
if [ "$cache" != off ] && [ -z "${KUNGFU_CI_COPY:-}" ] && [ ! -e target ] && [ ! -L target ]; then
  mkdir -p "$cache"
  exec 9>"$cache.lock"
  if ! flock -w 5400 9; then
    echo "test.sh: another run has held the build cache $cache for 90 minutes" >&2
    exit 1
  fi
  cache_gb=$(du -s --block-size=1G "$cache" | cut -f1)
  free_gb=$(df --output=avail --block-size=1G "$cache" | tail -1 | tr -d ' ')
  if [ "$cache_gb" -gt "${KUNGFU_BUILD_CACHE_GB:-30}" ] || [ "$free_gb" -lt 10 ]; then
    echo "(build cache: ${cache_gb} GiB, ${free_gb} GiB free on its disk: starting it afresh)"
    rm -rf "$cache" && mkdir -p "$cache"
  fi
  src="$(dirname "$cache")/src"
  rm -rf "$src" && mkdir -p "$src"
  tar -C . --exclude=./target -cf - . | tar -C "$src" -xf -
  ln -s "$cache" "$src/target"
  echo "(build cache: running in $src, target -> $cache, ${cache_gb} GiB)"
  # the lock (fd 9) stays held by the run
  KUNGFU_CI_COPY=1 exec "$src/scripts/test.sh" "$@"
fi

stage "system packages"
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin libopenmpi-dev)
# the C ABI tests: compile C and C++ against the installed library
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v c++ >/dev/null 2>&1 || need+=(g++)
command -v make >/dev/null 2>&1 || need+=(make)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
# the libfabric wire loads the system libfabric at run time (its tests use it)
ldconfig -p | grep -q 'libfabric\.so\.1 ' || need+=(libfabric1)
# the verbs wire's build: rdma-mummy-sys runs bindgen (libclang) and cmake
# over its vendored rdma-core headers (libibverbs itself is loaded at run time)
# (libclang itself: libclang-cpp, which other packages bring, is not it)
ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/*/libclang-[0-9]*.so* >/dev/null 2>&1 ||
  need+=(libclang-dev)
# the many-host tests (tools/tests/hosts): network namespaces (iproute2) and
# a real sshd in each (openssh-server; the package's own service is not
# started where a policy-rc.d forbids it, as in containers)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
# the config store in etcd (kungfu-run --config-store; tools/tests/etcd.rs)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
# ... with TLS across hosts: the tests call etcd's gateway inside a namespace
command -v curl >/dev/null 2>&1 || need+=(curl ca-certificates)
# scripts/doc-commands.py runs the docs' commands
command -v python3 >/dev/null 2>&1 || need+=(python3)
scripts/apt-need.sh ${need[@]+"${need[@]}"}
for c in rustfmt clippy; do
  if ! cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1; then
    rustup component add "$c"
  fi
done

# The torch venv of the Python stage (about 5 GB of download and unpacking
# when it is missing, two minutes here) is made in the background while
# the builds below use the cores; that stage waits for it.
venv_log="$(mktemp)"
setsid scripts/torch-venv.sh >"$venv_log" 2>&1 &
venv_pid=$!

stage "toolchain components"
# builds and the C ABI tests' scratch copies need disk: say what there is
df -h . "${TMPDIR:-/tmp}" 2>/dev/null || true

stage "cargo fmt --check"
cargo fmt --all -- --check
stage "file lengths (scripts/check-lines.sh: none over 800 lines, at most 5 library files over 600)"
scripts/check-lines.sh
# Every build below has the same features, so that each profile compiles
# the workspace once: the ones of the workspace's tests, plus the verbs
# wire (its lints with the runtime and launcher, its tests over the fake
# fabric of kungfu-transport's verbs-fake: tests/conformance_verbs.rs, and
# the clear error where there is no RDMA device). A user's build has no
# verbs unless asked for (its build needs cmake and libclang, installed
# above).
features=(--features kungfu-transport/verbs-fake,kungfu/verbs,kungfu-ffi/verbs,kungfu-tools/verbs,kungfu-tests/verbs)
stage "cargo clippy"
cargo clippy --workspace --all-targets --locked "${features[@]}" -- -D warnings
stage "cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked -q "${features[@]}"
# One dev build of every target (libraries, libkungfu.so/.a, the binaries the
# C ABI and launcher tests run, test and bench binaries) with the features
# of the test build: `cargo build` without --all-targets resolves features
# without the dev-dependencies (the conformance suite) and compiled the
# whole workspace a second time.
stage "cargo build --all-targets"
cargo build --workspace --all-targets --locked "${features[@]}"
stage "tests"
# In CI (.ci/run sets KUNGFU_CI=1) and as root, the tests that need root
# (the many-host tests' network namespaces, a small tmpfs) must run: one
# that would skip fails instead.
if [ "${KUNGFU_CI:-}" = 1 ] || [ "$(id -u)" = 0 ]; then
  export KUNGFU_REQUIRE_NETNS=1 KUNGFU_REQUIRE_ROOT=1
fi
# installed above: the etcd tests must run, not skip
export KUNGFU_REQUIRE_ETCD=1
if cargo nextest --version >/dev/null 2>&1; then
  # every test in a process of its own, four at a time across the binaries,
  # each bounded (.config/nextest.toml); the doc tests are cargo test's
  cargo nextest run --workspace --locked "${features[@]}" --no-tests=fail
  cargo test --workspace --doc --locked "${features[@]}"
else
  echo "(cargo-nextest is not installed: cargo test runs the binaries one after another)"
  cargo test --workspace --locked "${features[@]}"
fi
stage "benches (one quick pass each, so they never rot)"
# the bench targets only (`--benches` also ran every library's unit tests
# again: a library is a bench target too), of the build above
cargo test --workspace --bench '*' --locked "${features[@]}"
stage "Miri: the shm ring and the C ABI layer (scripts/miri.sh --quick)"
# skipped where its inputs and the toolchains are as when it last passed,
# on this machine or where .ci/green/miri was recorded (scripts/miri.sh
# --quick --record, committed with the change): CI's fresh machine has no
# record of its own
mapfile -t miri_inputs < <(scripts/miri.sh --inputs)
if scripts/ci-unchanged.sh miri "${miri_inputs[@]}"; then
  echo "(skipped: its inputs are as when it last passed; KUNGFU_CI_FULL=1 runs it)"
else
  scripts/miri.sh --quick
  scripts/ci-unchanged.sh --green miri "${miri_inputs[@]}"
fi
# The builds below are the release builds a user makes (without the verbs
# wire): the lints above did not see the code as they compile it, so a
# warning there is an error here too.
export RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-D warnings"
stage "the Python package and its torch tests (scripts/python-tests.sh: a cached venv with torch, pip install ./python, pytest)"
if ! wait "$venv_pid"; then
  cat "$venv_log"
  echo "test.sh: making the torch venv failed (scripts/torch-venv.sh)" >&2
  exit 1
fi
venv_pid=""
cat "$venv_log"
scripts/python-tests.sh
stage "the commands of README.md and docs/ (release builds, then each block)"
python3 scripts/doc-commands.py
stage "no test switch in the release builds (KUNGFU_TEST_SHM_STOP, KUNGFU_BENCH_CORRUPT_IN_PLACE)"
# They are read only by builds with the testing feature, which this
# repository's test builds turn on and a user's `cargo build` does not.
cargo build --release --locked -q -p kungfu-ffi
cargo build --release --locked -q -p kungfu-tools --bins
for f in target/release/libkungfu.so target/release/kungfu-run target/release/kungfu-bench; do
  if grep -a -q -e KUNGFU_TEST_SHM_STOP -e KUNGFU_BENCH_CORRUPT_IN_PLACE "$f"; then
    echo "test.sh: $f holds the name of a test switch" >&2
    exit 1
  fi
done
echo "none in libkungfu.so, kungfu-run, kungfu-bench"
# ... and a release job with both set runs as if they were not: no worker
# stopped at its first frame on shared memory, no in-place result corrupted
out=$(KUNGFU_TEST_SHM_STOP=kill:sent:1 KUNGFU_BENCH_CORRUPT_IN_PLACE=1 timeout 120 \
  target/release/kungfu-run -np 2 --transport shm --timeout 90s \
  target/release/kungfu-bench allreduce -b 4K -e 16K -f 4 -n 2 -w 1 2>&1) || {
  echo "$out"
  echo "test.sh: a release job failed with the test switches set" >&2
  exit 1
}
if ! grep -q "Out of bounds values : 0 OK" <<<"$out"; then
  echo "$out"
  echo "test.sh: a release kungfu-bench corrupted its result on a test switch" >&2
  exit 1
fi
echo "a release job with both set: every rank ran, 0 wrong"
stage "disk used by the build"
du -sh target 2>/dev/null || true
