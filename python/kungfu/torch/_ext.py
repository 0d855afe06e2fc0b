"""The torch extension (csrc/: ops.cpp, backend.cpp): compiled against the torch
of this environment on first use, cached, and loaded.

The extension has to match the installed torch exactly (its C++ ABI), so it
is built here rather than shipped: once per (torch, Python, source, header),
in `KUNGFU_TORCH_BUILD_DIR` (default `~/.cache/kungfu/torch-ext`), under a
file lock so that the workers of a job that start together build it once.
`python -m kungfu.torch.build` builds it ahead of time.
"""

import fcntl
import hashlib
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from .. import _capi

NAME = "_kungfu_torch"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "ops.cpp", CSRC / "backend.cpp"]
HEADERS = [CSRC / "kungfu_torch.h"]


def _build_dir() -> Path:
    env = os.environ.get("KUNGFU_TORCH_BUILD_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kungfu" / "torch-ext"


def _flags() -> list:
    torch_dir = Path(torch.__file__).resolve().parent
    inc = torch_dir / "include"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        *shlex.split(os.environ.get("CXX", "c++")), "-O2", "-std=c++20", "-fPIC",
        f"-DTORCH_EXTENSION_NAME={NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-isystem", str(inc), "-isystem", str(inc / "torch" / "csrc" / "api" / "include"),
        "-isystem", sysconfig.get_paths()["include"],
        "-I", str(_capi.include_dir()),
    ]


def _link(objects: list, out: Path) -> list:
    torch_dir = Path(torch.__file__).resolve().parent
    lib_dir = _capi.library_path().resolve().parent
    return [
        *shlex.split(os.environ.get("CXX", "c++")), "-shared", *map(str, objects), "-o", str(out),
        "-L", str(torch_dir / "lib"), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
        "-L", str(lib_dir), "-lkungfu", f"-Wl,-rpath,{lib_dir}",
    ]


def _run_all(cmds: list, verbose: bool) -> None:
    """Runs the compiler commands at once (one per source), raising with
    the first failure's output."""
    procs = []
    for cmd in cmds:
        if verbose:
            print("kungfu: building the torch extension:", shlex.join(cmd), flush=True)
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)))
    failed = None
    for cmd, p in procs:
        out, _ = p.communicate()
        if p.returncode != 0 and failed is None:
            failed = (cmd, out)
    if failed:
        cmd, out = failed
        raise ImportError(
            "kungfu: building the torch extension failed (a C++20 compiler is "
            f"needed; set CXX to choose one):\n$ {shlex.join(cmd)}\n{out[-8000:]}"
        )


def _key() -> str:
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        h.update(f.read_bytes())
    h.update((_capi.include_dir() / "kungfu.h").read_bytes())
    h.update(str(_capi.library_path().resolve()).encode())
    h.update(f"{torch.__version__}|{sys.version}|{os.environ.get('CXX', '')}".encode())
    return h.hexdigest()[:20]


def build(verbose: bool = False) -> Path:
    """Builds the extension if it is not in the cache; returns its path."""
    d = _build_dir() / _key()
    so = d / f"{NAME}.so"
    if so.is_file():
        return so
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if so.is_file():  # another worker built it meanwhile
            return so
        tmp = d / f"{NAME}.{os.getpid()}.so"
        objs = [d / f"{src.stem}.{os.getpid()}.o" for src in SOURCES]
        try:
            _run_all([_flags() + ["-c", str(src), "-o", str(o)] for src, o in zip(SOURCES, objs)],
                     verbose)
            _run_all([_link(objs, tmp)], verbose)
        except ImportError:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            for o in objs:
                o.unlink(missing_ok=True)
        os.replace(tmp, so)
    return so


def load():
    so = build()
    spec = importlib.util.spec_from_file_location(NAME, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
