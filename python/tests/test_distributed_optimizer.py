"""kungfu.torch.DistributedOptimizer (Horovod's API) against DDP on gloo:
model.SmallCNN, 4 processes, 20 steps of SGD with momentum from the same
seeds (workers/hvd_optimizer_worker.py, workers/ddp_worker.py). Every rank
ends with the same parameters, bit for bit, and the loss curve is gloo
DDP's within float tolerance (both average the gradients)."""

import json

import torch

from test_ddp import LOSS_TOL, NP, PARAM_TOL, STEPS, run_backend


def test_distributed_optimizer_matches_ddp_on_gloo(launcher, tmp_path):
    gloo = run_backend(launcher, tmp_path, "gloo", 25)
    launcher("workers/hvd_optimizer_worker.py", NP, tmp_path, STEPS, log_dir=tmp_path,
             name="hvd-optimizer")
    hvd = []
    for r in range(NP):
        d = json.loads((tmp_path / f"hvd-rank{r}.json").read_text())
        d["params"] = torch.load(tmp_path / f"hvd-rank{r}.pt")
        hvd.append(d)
    digests = {r["params_sha256"] for r in hvd}
    assert len(digests) == 1, f"the ranks' parameters differ: {digests}"
    assert all(r["params_equal_across_ranks"] for r in hvd)
    loss_diff = max(abs(a - b) for g, k in zip(gloo, hvd) for a, b in zip(g["losses"], k["losses"]))
    param_diff = float((gloo[0]["params"] - hvd[0]["params"]).abs().max())
    print(f"\nDistributedOptimizer {NP} ranks, {STEPS} steps: max |loss diff| against gloo DDP "
          f"{loss_diff:.3g}, max |param diff| {param_diff:.3g}")
    assert loss_diff <= LOSS_TOL, f"the loss curves differ by {loss_diff:.3g}"
    assert param_diff <= PARAM_TOL, f"the final parameters differ by {param_diff:.3g}"
