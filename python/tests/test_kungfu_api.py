"""KungFu's own API from Python (kungfu, beyond Horovod's): strategy swaps,
proposals and agreement, monitors, the stall report, bad input refused
(workers/adapt_worker.py); elastic resizing is test_elastic.py's."""

import pytest


@pytest.mark.parametrize("np", [2, 4])
def test_adaptation_calls(launcher, tmp_path, np):
    job = launcher("workers/adapt_worker.py", np, log_dir=tmp_path)
    for r in range(np):
        assert f"rank {r}: adaptation from Python ok" in job.output, job.shown()
