"""A pytest plugin (`-p kungfu_hvd_plugin`) for running Horovod's
test/parallel/test_torch.py against kungfu.torch under kungfu-run, one
pytest per rank (scripts/horovod-suite.sh).

* It gives each rank the environment that `horovodrun --gloo` gives
  (HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, ... from kungfu-run's
  KUNGFU_*), which the tests compare `hvd.rank()`/`hvd.size()` with and
  which makes them shut down and re-init between tests, as Horovod's CI
  does. KUNGFU_HVD_MODE=mpi sets OMPI_COMM_WORLD_RANK/SIZE instead (no
  shutdown between tests).
* test/utils/common.py imports `mock` and `cloudpickle`: where they are
  not installed, `unittest.mock` and `pickle` stand in.
* torch >= 2.9 has torch.optim.Muon, which only takes 2-D parameters: the
  tests that build every torch.optim optimizer for a model with biases
  fail with it whatever the backend. It is hidden from them (its
  `__module__` no longer starts with torch.optim) unless
  KUNGFU_HVD_HIDE_MUON=0.
* It writes one JSON line per test to $KUNGFU_HVD_RESULTS/rank<R>.jsonl:
  {"test", "outcome" (passed, failed, skipped, error), "reason", "seconds"},
  and a {"test", "outcome": "started"} line first, so a test that hangs
  is known.
* A test running longer than KUNGFU_HVD_TEST_TIMEOUT seconds (600) dumps
  every thread's stack and ends the process.
* Its pytest exit status goes to $KUNGFU_HVD_RESULTS/exit.rank<R>, and the
  process exits 0 (see `pytest_sessionfinish`).
"""

import faulthandler
import json
import os
import sys
import time

import pytest

_notes = []


def _environment():
    rank, size = os.environ.get("KUNGFU_RANK"), os.environ.get("KUNGFU_SIZE")
    if rank is None or size is None:
        return
    if os.environ.get("KUNGFU_HVD_MODE", "gloo") == "mpi":
        os.environ.setdefault("OMPI_COMM_WORLD_RANK", rank)
        os.environ.setdefault("OMPI_COMM_WORLD_SIZE", size)
        return
    local_rank = os.environ.get("KUNGFU_LOCAL_RANK", rank)
    local_size = os.environ.get("KUNGFU_LOCAL_SIZE", size)
    cross_size = max(int(size) // max(int(local_size), 1), 1)
    for k, v in {"HOROVOD_RANK": rank, "HOROVOD_SIZE": size,
                 "HOROVOD_LOCAL_RANK": local_rank, "HOROVOD_LOCAL_SIZE": local_size,
                 "HOROVOD_CROSS_RANK": str(int(rank) // max(int(local_size), 1)),
                 "HOROVOD_CROSS_SIZE": str(cross_size)}.items():
        os.environ.setdefault(k, v)


def _shims():
    try:
        import mock  # noqa: F401
    except ImportError:
        import unittest.mock
        sys.modules["mock"] = unittest.mock
        _notes.append("mock: unittest.mock stands in")
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        import pickle
        sys.modules["cloudpickle"] = pickle
        _notes.append("cloudpickle: pickle stands in")
    if os.environ.get("KUNGFU_HVD_HIDE_MUON", "1") != "0":
        import torch
        muon = getattr(torch.optim, "Muon", None)
        if muon is not None:
            muon.__module__ = "kungfu_hvd_plugin.hidden"
            _notes.append("torch.optim.Muon hidden from the optimizer loops (2-D parameters only)")


_environment()
_shims()

_out = None
_reports = {}
_started = {}


def pytest_configure(config):
    global _out
    d = os.environ.get("KUNGFU_HVD_RESULTS")
    if d:
        os.makedirs(d, exist_ok=True)
        _out = open(os.path.join(d, f"rank{os.environ.get('KUNGFU_RANK', '0')}.jsonl"), "w")


def pytest_report_header(config):
    return [f"kungfu_hvd_plugin: {n}" for n in _notes]


def _write(rec):
    if _out is not None:
        _out.write(json.dumps(rec) + "\n")
        _out.flush()


def _test(nodeid):
    return nodeid.split("::")[-1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    timeout = float(os.environ.get("KUNGFU_HVD_TEST_TIMEOUT", "600"))
    _started[item.nodeid] = time.time()
    _write({"test": _test(item.nodeid), "outcome": "started"})
    if timeout > 0:
        faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        yield
    finally:
        if timeout > 0:
            faulthandler.cancel_dump_traceback_later()


def _reason(report):
    lr = report.longrepr
    if lr is None:
        return ""
    if isinstance(lr, tuple) and len(lr) == 3:  # a skip: (file, line, reason)
        r = str(lr[2])
        return r[len("Skipped: "):] if r.startswith("Skipped: ") else r
    crash = getattr(lr, "reprcrash", None)
    msg = crash.message if crash is not None else str(lr).strip().splitlines()[-1]
    return " ".join(msg.split())[:600]


def pytest_runtest_logreport(report):
    _reports.setdefault(report.nodeid, []).append(report)


def pytest_runtest_logfinish(nodeid, location):
    reports = _reports.pop(nodeid, [])
    outcome, reason = "passed", ""
    for r in reports:
        if r.failed:
            outcome, reason = ("failed" if r.when == "call" else "error"), _reason(r)
            if r.when != "call":
                reason = f"in {r.when}: {reason}"
            break
        if r.skipped and outcome == "passed":
            outcome, reason = "skipped", _reason(r)
    _write({"test": _test(nodeid), "outcome": outcome, "reason": reason,
            "seconds": round(time.time() - _started.pop(nodeid, time.time()), 2)})


def pytest_sessionfinish(session, exitstatus):
    """Under the script, the rank's pytest status goes to its results
    directory (exit.rank<R>) and the process exits 0: kungfu-run stops
    every worker once one exits non-zero, which would cut the others
    short (a rank that crashes or hangs still exits non-zero)."""
    d = os.environ.get("KUNGFU_HVD_RESULTS")
    if not d:
        return
    with open(os.path.join(d, f"exit.rank{os.environ.get('KUNGFU_RANK', '0')}"), "w") as f:
        f.write(f"{int(exitstatus)}\n")
    session.exitstatus = 0
