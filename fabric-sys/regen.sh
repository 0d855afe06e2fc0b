#!/usr/bin/env bash
# Regenerates src/bindings.rs from the system libfabric headers with bindgen
# (gen/, its own little workspace; bindgen's version is pinned by
# gen/Cargo.lock). Needs, only here and never for a normal build:
#   apt-get install -y libfabric-dev libclang-dev pkg-config
# Usage: ./regen.sh        (then review `git diff src/bindings.rs`)
set -euo pipefail
cd "$(dirname "$0")"
incdir=$(pkg-config --variable=includedir libfabric)
version=$(pkg-config --modversion libfabric)
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/gen/target}"
cargo run --locked --release --quiet --manifest-path gen/Cargo.toml -- \
  src/bindings.rs "$incdir"
# bindgen formats with rustfmt already; once more with the crate's edition so
# `cargo fmt --check` agrees.
rustfmt --edition 2021 src/bindings.rs
echo "regen: src/bindings.rs from libfabric $version headers in $incdir ($(wc -l < src/bindings.rs) lines)"
