"""libkungfu through ctypes: loading it, its prototypes, and errors.

Only kungfu.h is used, as by any C program. The library is the one bundled
in the package (`kungfu/_lib/libkungfu.so`), or `KUNGFU_LIB` if set.
"""

import ctypes as C
import os
from pathlib import Path

LIB_DIR = Path(__file__).resolve().parent / "_lib"

# kungfu.h's numbers
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_NOT_INITIALIZED = 2
ERR_MISMATCH = 3
ERR_PEER_LOST = 4
ERR_TIMEOUT = 5
ERR_ABORTED = 6
ERR_DUPLICATE_NAME = 7
ERR_MEMBERSHIP_CHANGED = 8
ERR_INTERNAL = 9
ERR_FINALIZED = 10
ERR_BOOTSTRAP = 11
ERR_TRANSPORT = 12
PENDING = 13

STRATEGIES = {
    "auto": 0,
    "star": 1,
    "ring": 2,
    "tree": 3,
    "binary_tree": 4,
    "binary_tree_star": 5,
    "multi_binary_tree_star": 6,
    "clique": 7,
    "recursive_doubling": 8,
}
TRANSPORTS = {"auto": 0, "tcp": 1, "shm": 2, "quic": 3, "fabric": 4, "verbs": 5}


class KungFuError(RuntimeError):
    """A call into libkungfu failed. `status` is kungfu.h's code; the
    message names the rank (`kungfu: rank R: ...`) and the cause."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


class PeerLostError(KungFuError):
    """A peer was lost (`KF_ERR_PEER_LOST`): `kungfu.recover()` shrinks the
    cluster to the survivors."""


class MembershipChangedError(KungFuError):
    """The cluster went on without this worker (`KF_ERR_MEMBERSHIP_CHANGED`)."""


class MismatchError(KungFuError):
    """The ranks disagree on an op (`KF_ERR_MISMATCH`): its kind, root, type
    or count, or a length a call gave. Every rank of the op gets it, and the
    message names the ranks that disagree."""


def library_path() -> Path:
    env = os.environ.get("KUNGFU_LIB")
    path = Path(env) if env else LIB_DIR / "libkungfu.so"
    if not path.is_file():
        raise ImportError(
            f"kungfu: {path} does not exist: reinstall the package "
            "(`pip install ./python` builds and bundles libkungfu), or set KUNGFU_LIB"
        )
    return path


def include_dir() -> Path:
    env = os.environ.get("KUNGFU_INCLUDE")
    return Path(env) if env else LIB_DIR / "include"


_lib = C.CDLL(str(library_path()), mode=C.RTLD_GLOBAL)

_i32, _i64, _u64, _dbl = C.c_int32, C.c_int64, C.c_uint64, C.c_double


class Action(C.Structure):
    """kungfu.h's `kf_action`."""

    _fields_ = [("kind", _i32), ("custom_kind", C.c_uint32), ("value", _u64)]


class PeerStats(C.Structure):
    """kungfu.h's `kf_peer_stats`."""

    _fields_ = [("ops", C.c_uint64), ("frames", C.c_uint64), ("bytes", C.c_uint64),
                ("rate", C.c_double), ("mean_latency", C.c_double)]


ACTION_SET_STRATEGY = 1
ACTION_RESIZE = 2
ACTION_SET_BATCH_SIZE = 3
ACTION_CUSTOM = 4
ACTION_SET_TRANSPORT = 5
_P = C.POINTER
_PROTOS = {
    "kf_init": ([], _i32),
    "kf_finalize": ([], _i32),
    "kf_rank": ([], C.c_int),
    "kf_size": ([], C.c_int),
    "kf_local_rank": ([], C.c_int),
    "kf_local_size": ([], C.c_int),
    "kf_cluster_version": ([], _u64),
    "kf_version": ([], _i64),
    "kf_status_string": ([_i32], C.c_char_p),
    "kf_last_error": ([], C.c_char_p),
    "kf_set_strategy": ([_i32], _i32),
    "kf_set_transport": ([_i32], _i32),
    "kf_propose_new_size": ([_i32], _i32),
    "kf_resize": ([_i32, _P(_i32), _P(_i32)], _i32),
    "kf_resize_from_config": ([_P(_i32), _P(_i32)], _i32),
    "kf_poll_resize": ([_P(_i32), _P(_i32)], _i32),
    "kf_sync_state": ([_P(_u64), _P(C.c_char_p), _P(C.c_void_p), _P(_u64), _i32], _i32),
    "kf_recover": ([], _i32),
    "kf_propose": ([_P(Action)], _i32),
    "kf_agree": ([_u64, _P(Action), _i32, _P(_i32)], _i32),
    "kf_stall_report": ([C.c_char_p, _i32, _P(_i32)], _i32),
    "kf_get_peer_stats": ([_P(PeerStats), _i32, _P(_i32)], _i32),
    "kf_reset_stats": ([], _i32),
    "kf_save": ([C.c_char_p, C.c_void_p, C.c_size_t, _P(_u64)], _i32),
    "kf_request": ([_i32, C.c_char_p, C.c_void_p, C.c_size_t, _P(_u64), C.c_void_p,
                    C.c_void_p, _P(_u64)], _i32),
    "kf_sq_norm": ([_P(C.c_float), _u64, _P(_dbl)], _i32),
    "kf_noise_scale": ([C.c_char_p, _dbl, _dbl, _dbl, _dbl, _dbl, _P(_dbl)], _i32),
    "kf_gradient_variance": ([_dbl, _dbl], _dbl),
    "kf_barrier": ([C.c_void_p, C.c_void_p, _P(_u64)], _i32),
    "kf_wait": ([_u64, _i64], _i32),
    "kf_release": ([_u64], _i32),
    "kf_broadcast": (
        [C.c_void_p, C.c_void_p, C.c_size_t, _i32, C.c_int, C.c_char_p,
         C.c_void_p, C.c_void_p, _P(_u64)], _i32),
    "kf_allgather": (
        [C.c_void_p, C.c_void_p, C.c_size_t, _i32, C.c_char_p,
         C.c_void_p, C.c_void_p, _P(_u64)], _i32),
    "kf_allreduce": (
        [C.c_void_p, C.c_void_p, C.c_size_t, _i32, _i32, C.c_char_p,
         C.c_void_p, C.c_void_p, _P(_u64)], _i32),
}
for _name, (_args, _res) in _PROTOS.items():
    _f = getattr(_lib, _name)
    _f.argtypes, _f.restype = _args, _res

lib = _lib


def rank_or_unknown() -> str:
    r = _lib.kf_rank()
    return str(r) if r >= 0 else "?"


def error(fn: str, status: int) -> KungFuError:
    detail = _lib.kf_last_error()
    text = _lib.kf_status_string(status).decode()
    msg = f"kungfu: rank {rank_or_unknown()}: {fn} failed: {text}"
    if detail:
        msg += f": {detail.decode(errors='replace')}"
    cls = {
        ERR_PEER_LOST: PeerLostError,
        ERR_MEMBERSHIP_CHANGED: MembershipChangedError,
        ERR_MISMATCH: MismatchError,
    }
    return cls.get(status, KungFuError)(msg, status)


def check(fn: str, *args) -> None:
    """Calls `kf_<fn>` and raises `KungFuError` unless it returned KF_OK."""
    status = getattr(_lib, fn)(*args)
    if status != OK:
        raise error(fn, status)


def wait(fn: str, issue) -> None:
    """Runs a blocking op: `issue(handle_ptr)` starts it (no callback); this
    waits for it and releases the handle, raising its error."""
    h = _u64(0)
    status = issue(C.byref(h))
    if status != OK:
        raise error(fn, status)
    status = _lib.kf_wait(h, -1)
    err = error(fn, status) if status != OK else None
    _lib.kf_release(h)
    if err:
        raise err
