"""kungfu.torch.DistributedOptimizer (Horovod's API) against DDP on gloo:
model.SmallCNN, 4 processes, 20 steps of SGD with momentum from the same
seeds (workers/hvd_optimizer_worker.py, workers/ddp_worker.py). Every rank
ends with the same parameters, bit for bit, and the loss curve is gloo
DDP's within float tolerance (both average the gradients)."""

import json

import torch

from launch import saved_runs
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


DEEP_STEPS = 6
DEEP_TOL = 1e-4


def test_fused_optimizer_on_207_tensors_matches_ddp_on_gloo(launcher, tmp_path):
    """kungfu.torch's DistributedOptimizer, its gradients fused into
    buckets of KUNGFU_FUSION_BYTES = 64 KiB (10 buckets: the default makes
    one of this model), on model.TinyTransformer with 207 parameter tensors
    against DDP on gloo, 4 processes: the same parameters on every rank,
    and gloo DDP's loss curve and final parameters within DEEP_TOL."""
    launcher("workers/deep_worker.py", NP, "ddp-gloo", tmp_path, DEEP_STEPS, log_dir=tmp_path,
             name="deep-ddp-gloo")
    gloo = saved_runs(tmp_path, "ddp-gloo", NP)
    assert gloo[0]["tensors"] >= 200
    for fusion in (64 << 10,):
        extra = () if fusion is None else (fusion,)
        launcher("workers/deep_worker.py", NP, "hvd", tmp_path, DEEP_STEPS, *extra,
                 log_dir=tmp_path, name=f"deep-hvd-{fusion}")
        hvd = saved_runs(tmp_path, "hvd", NP)
        assert all(r["params_equal_across_ranks"] for r in hvd)
        loss_diff = max(abs(a - b) for g, k in zip(gloo, hvd)
                        for a, b in zip(g["losses"], k["losses"]))
        param_diff = float((gloo[0]["params"] - hvd[0]["params"]).abs().max())
        print(f"\nfused DistributedOptimizer ({hvd[0]['tensors']} tensors, "
              f"{hvd[0]['buckets']} buckets), {NP} ranks: loss {hvd[0]['losses'][0]:.4f} -> "
              f"{hvd[0]['losses'][-1]:.4f}; against gloo DDP: max |loss diff| {loss_diff:.3g}, "
              f"max |param diff| {param_diff:.3g}")
        if fusion is not None:
            assert hvd[0]["buckets"] > 1
        assert hvd[0]["losses"][-1] < hvd[0]["losses"][0], "the loss did not fall"
        assert loss_diff <= DEEP_TOL, f"the loss curves differ by {loss_diff:.3g}"
        assert param_diff <= DEEP_TOL, f"the final parameters differ by {param_diff:.3g}"
