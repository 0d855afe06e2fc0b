"""DistributedDataParallel over the kungfu backend against gloo: model.SmallCNN,
4 processes, 20 steps of SGD from the same seeds, once per backend
(workers/ddp_worker.py). With DDP's default buckets (one here) and with
tiny ones (several all_reduces in flight per step).

- on each backend, every rank ends with the same parameters, bit for bit
  (their SHA-256, and an all_gather over the backend itself);
- kungfu's loss curve is gloo's, rank by rank, within float tolerance
  (another summation order changes the last bits of a gradient), and so are
  the final parameters. The figures are printed (pytest -s).
"""

import pytest

from launch import saved_runs

NP = 4
STEPS = 20
LOSS_TOL = 1e-4
PARAM_TOL = 1e-4


def run_backend(launcher, out, backend, bucket_mb):
    launcher("workers/ddp_worker.py", NP, backend, out, STEPS, bucket_mb, log_dir=out,
             name=f"ddp-{backend}")
    return saved_runs(out, backend, NP)


@pytest.mark.parametrize("bucket_mb", [25, 0.002], ids=["default-buckets", "tiny-buckets"])
def test_ddp_kungfu_matches_gloo(launcher, tmp_path, bucket_mb):
    gloo = run_backend(launcher, tmp_path, "gloo", bucket_mb)
    kf = run_backend(launcher, tmp_path, "kungfu", bucket_mb)
    for runs in (gloo, kf):
        name = runs[0]["backend"]
        digests = {r["params_sha256"] for r in runs}
        assert len(digests) == 1, f"{name}: the ranks' parameters differ: {digests}"
        assert all(r["params_equal_across_ranks"] for r in runs), f"{name}: all_gather says they differ"
        assert all(len(r["losses"]) == STEPS for r in runs)
    loss_diff = max(abs(a - b) for g, k in zip(gloo, kf) for a, b in zip(g["losses"], k["losses"]))
    param_diff = float((gloo[0]["params"] - kf[0]["params"]).abs().max())
    exact = gloo[0]["params_sha256"] == kf[0]["params_sha256"]
    buckets = len(kf[0]["rebuilt_bucket_sizes"].split(","))
    if bucket_mb < 1:
        assert buckets > 1, f"tiny buckets, but DDP made {kf[0]['rebuilt_bucket_sizes']}"
    mean = [sum(r["losses"][s] for r in kf) / NP for s in range(STEPS)]
    print(f"\nDDP {NP} ranks, {STEPS} steps, bucket_cap_mb={bucket_mb} "
          f"({buckets} buckets): max |loss diff| kungfu-gloo "
          f"{loss_diff:.3g}, max |param diff| {param_diff:.3g} (bit-identical: {exact}); "
          f"kungfu mean loss {mean[0]:.4f} -> {mean[-1]:.4f}")
    assert loss_diff <= LOSS_TOL, f"the loss curves differ by {loss_diff:.3g}"
    assert param_diff <= PARAM_TOL, f"the final parameters differ by {param_diff:.3g}"
