"""A 2x2 DeviceMesh over the kungfu backend (workers/mesh_worker.py): data
parallel on one axis, tensor parallel on the other, so that every step
runs collectives in two kinds of subgroups (the "tp" pairs in the forward
and backward passes, the "dp" pairs on the gradients). After 5 steps its
losses and full parameters are those of the model trained on the whole
batches in one process, within float tolerance, on gloo and on kungfu;
fc1 and fc2's weights are shards, half of the whole each. The figures are
printed (pytest -s).
"""

import json

import pytest

STEPS = 5
TOL = 1e-5


@pytest.mark.parametrize("backend", ["gloo", "kungfu"])
def test_mesh_matches_one_process(launcher, tmp_path, backend):
    launcher("workers/mesh_worker.py", 4, backend, tmp_path, STEPS, log_dir=tmp_path,
             name=f"mesh-{backend}")
    runs = [json.loads((tmp_path / f"{backend}-rank{r}.json").read_text()) for r in range(4)]
    assert sorted((r["dp"], r["tp"]) for r in runs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in runs:
        assert r["shards"]["fc1.weight"] == [16, 12], r["shards"]
        assert r["shards"]["fc2.weight"] == [6, 16], r["shards"]
    losses, ref = runs[0]["losses"], runs[0]["ref_losses"]
    assert len(losses) == STEPS
    loss_diff = max(abs(a - b) for r in runs for a, b in zip(r["losses"], ref))
    param_diff = max(r["param_diff"] for r in runs)
    print(f"\n2x2 mesh on {backend}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; against one "
          f"process: max |loss diff| {loss_diff:.3g}, max |param diff| {param_diff:.3g}")
    assert losses[-1] < losses[0], "the loss did not fall"
    assert loss_diff <= TOL, f"the losses differ from one process's by {loss_diff:.3g}"
    assert param_diff <= TOL, f"the parameters differ from one process's by {param_diff:.3g}"
