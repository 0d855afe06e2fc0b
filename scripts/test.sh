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
  stage ""
  echo "== time per stage (rc=$rc)"
  printf '%s\n' "${stage_log[@]}"
  printf '%6ds  total\n' "$SECONDS"
}
trap stage_times EXIT

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

stage "toolchain components"
# builds and the C ABI tests' scratch copies need disk: say what there is
df -h . "${TMPDIR:-/tmp}" 2>/dev/null || true

stage "cargo fmt --check"
cargo fmt --all -- --check
stage "no source file over 800 lines (scripts/check-lines.sh)"
scripts/check-lines.sh
stage "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
stage "cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked -q
# One dev build of every target (libraries, libkungfu.so/.a, the binaries the
# C ABI and launcher tests run, test and bench binaries) with the features
# of the test build: `cargo build` without --all-targets resolves features
# without the dev-dependencies (the conformance suite) and compiled the
# whole workspace a second time.
stage "cargo build --all-targets"
cargo build --workspace --all-targets --locked
stage "tests"
# as root (CI is), the many-host tests must run, not skip
[ "$(id -u)" != 0 ] || export KUNGFU_REQUIRE_NETNS=1
# installed above: the etcd tests must run, not skip
export KUNGFU_REQUIRE_ETCD=1
if cargo nextest --version >/dev/null 2>&1; then
  # every test in a process of its own, two at a time across the binaries,
  # each bounded (.config/nextest.toml); the doc tests are cargo test's
  cargo nextest run --workspace --locked --no-tests=fail
  cargo test --workspace --doc --locked
else
  echo "(cargo-nextest is not installed: cargo test runs the binaries one after another)"
  cargo test --workspace --locked
fi
stage "benches (one quick pass each, so they never rot)"
# the bench targets only (`--benches` also ran every library's unit tests
# again: a library is a bench target too), of the build above
cargo test --workspace --bench '*' --locked
stage "the verbs wire (feature verbs): lints with the runtime, tests over the fake fabric and the clear error here"
verbs_inputs=(transport tests/src/conformance tests/tests/conformance_verbs.rs Cargo.lock)
if scripts/ci-unchanged.sh verbs "${verbs_inputs[@]}"; then
  echo "(skipped: its sources are as when it last passed on this machine; KUNGFU_CI_FULL=1 runs it)"
else
  cargo clippy -p kungfu-transport -p kungfu -p kungfu-tests --all-targets --locked \
    --features kungfu-transport/verbs,kungfu/verbs,kungfu-tests/verbs -- -D warnings
  cargo test -p kungfu-transport --features verbs --locked verbs::
  cargo test -p kungfu-tests --features verbs --locked --test conformance_verbs
  scripts/ci-unchanged.sh --green verbs "${verbs_inputs[@]}"
fi
stage "Miri: the shm ring and the C ABI layer (scripts/miri.sh --quick)"
miri_inputs=(transport/src ffi/src scripts/miri.sh scripts/miri-shm.sh scripts/miri-region.sh scripts/miri-ffi.sh Cargo.lock)
if scripts/ci-unchanged.sh miri "${miri_inputs[@]}"; then
  echo "(skipped: its sources are as when it last passed on this machine; KUNGFU_CI_FULL=1 runs it)"
else
  scripts/miri.sh --quick
  scripts/ci-unchanged.sh --green miri "${miri_inputs[@]}"
fi
stage "the Python package and its torch tests (scripts/python-tests.sh: a cached venv with torch, pip install ./python, pytest)"
scripts/python-tests.sh
stage "the commands of README.md and docs/ (release builds, then each block)"
python3 scripts/doc-commands.py
stage "disk used by the build"
du -sh target 2>/dev/null || true
