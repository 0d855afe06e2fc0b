#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine with Rust installed:
# installs the system packages the tests need, then checks formatting,
# lints and docs, runs every test, builds and smoke-runs the benches, and
# runs the unsafe code that Miri can run under Miri, the Python package's
# torch tests (scripts/python-tests.sh), and every command block of
# README.md and docs/ (scripts/doc-commands.py).
set -euo pipefail
cd "$(dirname "$0")/.."

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

# builds and the C ABI tests' scratch copies need disk: say what there is
df -h . "${TMPDIR:-/tmp}" 2>/dev/null || true

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== no source file over 800 lines (scripts/check-lines.sh)"
scripts/check-lines.sh
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked -q
echo "== cargo build (libkungfu.so/.a and kungfu-run, which the C ABI tests use)"
cargo build --workspace --locked
echo "== cargo test"
# as root (CI is), the many-host tests must run, not skip
[ "$(id -u)" != 0 ] || export KUNGFU_REQUIRE_NETNS=1
# installed above: the etcd tests must run, not skip
export KUNGFU_REQUIRE_ETCD=1
cargo test --workspace --locked
echo "== the verbs wire (feature verbs): lints with the runtime, tests over the fake fabric and the clear error here"
cargo clippy -p kungfu-transport -p kungfu --all-targets --locked \
  --features kungfu-transport/verbs,kungfu-transport/conformance,kungfu/verbs -- -D warnings
cargo test -p kungfu-transport --features verbs,conformance --locked verbs::
echo "== benches (one quick pass each, so they never rot)"
cargo test --workspace --benches --locked
echo "== Miri: the shm ring and the C ABI layer (scripts/miri.sh --quick)"
scripts/miri.sh --quick
echo "== the Python package and its torch tests (scripts/python-tests.sh: a cached venv with torch, pip install ./python, pytest)"
scripts/python-tests.sh
echo "== the commands of README.md and docs/ (release builds, then each block)"
python3 scripts/doc-commands.py
echo "== disk used by the build"
du -sh target 2>/dev/null || true
