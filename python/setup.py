"""Builds libkungfu with cargo and bundles it (and kungfu.h) in the package.

`pip install ./python` from a clone runs `cargo build --release -p
kungfu-ffi` in the workspace above this directory. `KUNGFU_LIB=/path/to/
libkungfu.so` bundles a library built elsewhere instead (then kungfu.h is
taken from `KUNGFU_INCLUDE`, or from the workspace).
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
WORKSPACE = HERE.parent


def _cargo_build() -> Path:
    if not (WORKSPACE / "Cargo.toml").is_file():
        raise SystemExit(
            f"kungfu: no Cargo workspace at {WORKSPACE}: install from a clone of "
            "KungFu-rs, or set KUNGFU_LIB to a built libkungfu.so"
        )
    cargo = os.environ.get("CARGO", shutil.which("cargo") or str(Path.home() / ".cargo/bin/cargo"))
    cmd = [cargo, "build", "--release", "--locked", "-p", "kungfu-ffi",
           "--manifest-path", str(WORKSPACE / "Cargo.toml")]
    print("kungfu: building libkungfu:", " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True)
    except FileNotFoundError:
        raise SystemExit("kungfu: cargo not found: install Rust (https://rustup.rs) "
                         "or set KUNGFU_LIB to a built libkungfu.so")
    target = Path(os.environ.get("CARGO_TARGET_DIR", WORKSPACE / "target"))
    if not target.is_absolute():
        target = WORKSPACE / target
    return target / "release" / "libkungfu.so"


class BuildWithLibrary(build_py):
    def run(self):
        lib = Path(os.environ["KUNGFU_LIB"]) if os.environ.get("KUNGFU_LIB") else _cargo_build()
        header = Path(os.environ.get("KUNGFU_INCLUDE", WORKSPACE / "ffi" / "include")) / "kungfu.h"
        for f in (lib, header):
            if not f.is_file():
                raise SystemExit(f"kungfu: {f} does not exist")
        dest = HERE / "kungfu" / "_lib"
        (dest / "include").mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, dest / "libkungfu.so")
        shutil.copy2(header, dest / "include" / "kungfu.h")
        # an in-tree build reuses build/: files of an earlier version left
        # there would go into the wheel
        shutil.rmtree(Path(self.build_lib) / "kungfu", ignore_errors=True)
        super().run()


class NativeDistribution(Distribution):
    """The wheel holds a native library: tag it for this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=NativeDistribution)
