"""The adaptation experiments (benches/adaptation/run.py) in their short
form: one small round of each, into a scratch directory, so that the
scripts keep working. The figures of the docs come from full runs."""

import json
import os
import subprocess
import sys

import launch
import pytest


@pytest.mark.parametrize("name", ["batch", "sync", "monitor", "interference", "scale"])
def test_experiment_runs_in_short(name, kungfu_run, torch_ext, tmp_path):
    env = launch.worker_env({"KUNGFU_RUN": str(kungfu_run), launch.TAG_VAR: f"exp-{name}"})
    cmd = [sys.executable, str(launch.REPO / "benches" / "adaptation" / "run.py"), "--short",
           "--only", name, "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    rows = doc["tables"][0]["rows"]
    assert rows, doc
    assert (tmp_path / f"{name}.svg").read_text().startswith("<svg"), name
    if name == "scale":
        assert all(r[2] in (1, 2, 4) for r in rows), rows
    assert os.path.getsize(tmp_path / f"{name}.json") > 0
