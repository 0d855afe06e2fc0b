"""A 2-stage pipeline (torch.distributed.pipelining, GPipe) over the kungfu
backend, whose activations and gradients go by send/recv
(workers/pipeline_worker.py): after 5 steps its losses and each stage's
parameters are those of the same model trained in one process, within
float tolerance (microbatches sum gradients in another order), and so with
gloo. The figures are printed (pytest -s).
"""

import json

import pytest

STEPS = 5
TOL = 1e-5


@pytest.mark.parametrize("backend", ["gloo", "kungfu"])
def test_pipeline_matches_one_process(launcher, tmp_path, backend):
    launcher("workers/pipeline_worker.py", 2, backend, tmp_path, STEPS, log_dir=tmp_path,
             name=f"pipeline-{backend}")
    runs = [json.loads((tmp_path / f"{backend}-rank{r}.json").read_text()) for r in range(2)]
    losses, ref = runs[1]["losses"], runs[1]["ref_losses"]
    assert len(losses) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref))
    param_diff = max(r["param_diff"] for r in runs)
    print(f"\npipeline on {backend}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; against one "
          f"process: max |loss diff| {loss_diff:.3g}, max |param diff| {param_diff:.3g}")
    assert losses[-1] < losses[0], "the loss did not fall"
    assert loss_diff <= TOL, f"the losses differ from one process's by {loss_diff:.3g}"
    assert param_diff <= TOL, f"the parameters differ from one process's by {param_diff:.3g}"
