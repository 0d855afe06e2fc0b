"""Elastic training from Python.

`resize` (under `kungfu-run -w -np 2`): the cluster grows to 3 at step 6
and shrinks to 2 at step 14 (proposed by rank 0 through the config server,
applied at `state.commit()`). `kill` (under `kungfu-run -np 3 --on-failure
shrink`): rank 2 is killed at step 7; the survivors recover, roll back to
the last commit and finish as 2. Either way the model, the optimizer's
momentum and an extra (`epoch`) must be the same on every worker at every
step, a joiner's included, and the model must be what the step says."""

import os
import signal
import sys

import torch

import kungfu
import kungfu.torch as kt
from kungfu.torch import elastic

STEPS = 20
MODE = sys.argv[1] if len(sys.argv) > 1 else "resize"
torch.manual_seed(0)
model = torch.nn.Linear(8, 4, bias=False)
with torch.no_grad():
    model.weight.zero_()
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def expected_weight(step):
    """Plain SGD with momentum on a gradient of ones, `step` times."""
    w, buf = torch.zeros(4, 8), None
    for _ in range(step):
        g = torch.ones(4, 8)
        buf = g.clone() if buf is None else buf * 0.9 + g
        w = w - 0.5 * buf
    return w


def same_everywhere(t, name):
    lo = kt.allreduce(t, op=kt.Min, name=name + "/min")
    hi = kt.allreduce(t, op=kt.Max, name=name + "/max")
    return torch.equal(lo, hi)


kt.init()
# the resize at the step it was proposed at, so that the steps are known
state = elastic.TorchState(model, opt, epoch=0, wait_for_new_workers=True)
sizes = []


@elastic.run
def train(state):
    while state.step < STEPS:
        me, n = kungfu.rank(), kungfu.size()
        if MODE == "kill" and n == 3 and me == 2 and state.step == 7:
            os.kill(os.getpid(), signal.SIGKILL)
        # every worker's gradient differs; their mean is ones
        opt.zero_grad()
        model.weight.grad = torch.ones(4, 8) + (me - (n - 1) / 2)
        g = model.weight.grad
        kt.allreduce_(g, op=kt.Average, name=f"grad/{state.step}")
        opt.step()
        state.step += 1
        state.epoch = state.step // 5
        w = model.weight.detach()
        assert torch.allclose(w, expected_weight(state.step), atol=1e-4), (
            f"rank {me}: step {state.step}: weight {w[0, 0].item()}, "
            f"expected {expected_weight(state.step)[0, 0].item()}")
        mom = opt.state[model.weight]["momentum_buffer"]
        assert same_everywhere(mom, f"mom/{state.step}"), f"rank {me}: momentum differs"
        ep = torch.tensor([state.epoch])
        assert same_everywhere(ep, f"epoch/{state.step}"), f"rank {me}: epoch differs"
        if MODE == "resize" and me == 0 and state.step in (6, 14):
            kungfu.propose_new_size(3 if state.step == 6 else 2)
        sizes.append(n)
        state.commit()
    return state.step


done = train(state)
if done is None:
    print(f"kungfu elastic: a worker left at step {state.step}", flush=True)
else:
    print(f"kungfu elastic: rank {kungfu.rank()} of {kungfu.size()} finished step {done}, "
          f"version {kungfu.version()}, sizes seen {sorted(set(sizes))}", flush=True)
sys.exit(0)
