"""FSDP2 (fully_shard) over the kungfu backend against gloo: a small
transformer (workers/fsdp_worker.py), 2 and 4 processes, 10 steps of SGD
from the same seed, once per backend.

- on each backend, every rank ends with the same full parameters, and
  holds only its shard of them;
- kungfu's loss curve is gloo's, rank by rank, within float tolerance, and
  so are the final parameters. The figures are printed (pytest -s).
"""

import pytest

from launch import saved_runs

STEPS = 10
LOSS_TOL = 1e-4
PARAM_TOL = 1e-4


def run_backend(launcher, out, backend, np):
    launcher("workers/fsdp_worker.py", np, backend, out, STEPS, log_dir=out,
             name=f"fsdp-{backend}")
    return saved_runs(out, backend, np)


@pytest.mark.parametrize("np", [2, 4])
def test_fsdp_kungfu_matches_gloo(launcher, tmp_path, np):
    gloo = run_backend(launcher, tmp_path, "gloo", np)
    kf = run_backend(launcher, tmp_path, "kungfu", np)
    for runs in (gloo, kf):
        name = runs[0]["backend"]
        digests = {r["params_sha256"] for r in runs}
        assert len(digests) == 1, f"{name}: the ranks' full parameters differ: {digests}"
        assert all(r["params_equal_across_ranks"] for r in runs)
        assert all(len(r["losses"]) == STEPS for r in runs)
        assert all(r["local_numel"] < r["numel"] for r in runs), f"{name}: not sharded"
    loss_diff = max(abs(a - b) for g, k in zip(gloo, kf) for a, b in zip(g["losses"], k["losses"]))
    param_diff = float((gloo[0]["params"] - kf[0]["params"]).abs().max())
    mean = [sum(r["losses"][s] for r in kf) / np for s in range(STEPS)]
    print(f"\nFSDP2 {np} ranks, {STEPS} steps: max |loss diff| kungfu-gloo {loss_diff:.3g}, "
          f"max |param diff| {param_diff:.3g}; kungfu mean loss {mean[0]:.4f} -> {mean[-1]:.4f}")
    assert mean[-1] < mean[0], "the loss did not fall"
    assert loss_diff <= LOSS_TOL, f"the loss curves differ by {loss_diff:.3g}"
    assert param_diff <= PARAM_TOL, f"the final parameters differ by {param_diff:.3g}"
