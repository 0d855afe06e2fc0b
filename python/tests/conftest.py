"""Shared set-up of the Python tests: each test runs worker scripts (in
workers/) under `kungfu-run -np N` through launch.py, and checks what they
wrote into the test's tmp_path.

Run (from the repository; the torch venv of scripts/torch-venv.sh):

    cargo build --release -p kungfu-tools --bin kungfu-run
    PYTHONPATH=python ~/.cache/kungfu-torch-venv/bin/python -m pytest python/tests -q

`KUNGFU_RUN` chooses another kungfu-run. The torch extension is built once
here, in the test process, before any job starts (so that no job's timeout
is spent compiling it).
"""

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import launch  # noqa: E402

if launch.needs_repo_path() and str(launch.PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(launch.PYTHON_DIR))


@pytest.fixture(scope="session")
def kungfu_run():
    """The launcher's path; fails every test that needs it if it is missing."""
    path = launch.kungfu_run()
    if not path.is_file():
        pytest.fail(f"kungfu-run not found at {path}: build it with `cargo build --release "
                    "-p kungfu-tools --bin kungfu-run`, or set KUNGFU_RUN", pytrace=False)
    return path


@pytest.fixture(scope="session")
def torch_ext():
    """Builds (or finds in its cache) the torch extension; returns its path."""
    from kungfu.torch import _ext

    return _ext.build()


@pytest.fixture(scope="session")
def launcher(kungfu_run, torch_ext):
    """launch.run_job, once kungfu-run and the extension are there."""
    return launch.run_job
