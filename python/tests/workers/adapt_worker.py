"""KungFu's own calls from Python, beyond Horovod's (under kungfu-run -np N):
a strategy swap (then ops on it), proposals and agreement, the noise
scale and variance monitors, the stall report, and refusals of bad input."""

import math

import torch

import kungfu
import kungfu.torch as hvd

hvd.init()
me, n = kungfu.rank(), kungfu.size()

for strategy in ("ring", "binary_tree_star", "star", "auto"):
    kungfu.set_strategy(strategy)
    t = hvd.allreduce(torch.full((1000,), float(me + 1)), op=hvd.Sum, name=f"after/{strategy}")
    assert torch.all(t == n * (n + 1) / 2), (strategy, t[:3])

# proposals: rank 1's strategy, rank 0's custom action; every rank gets both
if me == 1:
    kungfu.propose(kungfu.Action("set_strategy", kungfu.STRATEGIES["ring"]))
if me == 0:
    kungfu.propose(kungfu.Action("custom", 42, custom_kind=7))
agreed = kungfu.agree(1)
assert kungfu.Action("custom", 42, custom_kind=7) in agreed, agreed
assert kungfu.Action("set_strategy", kungfu.STRATEGIES["ring"]) in agreed, agreed
assert kungfu.agree(2) == [], "proposals are used once"

# monitors: a worker's gradient and the mean one
ns = kungfu.NoiseScale("grad", alpha=0.5)
estimate = float("nan")
for step in range(4):
    g = torch.ones(256) + torch.randn(256, generator=torch.Generator().manual_seed(step * 10 + me))
    small = float(g.pow(2).sum())
    mean = hvd.allreduce(g, op=hvd.Average, name=f"grad/{step}")
    big = float(mean.pow(2).sum())
    estimate = ns.update(small, big, 32, 32 * n)
    var = kungfu.gradient_variance(small, big)
    assert var >= 0, var
assert not math.isnan(estimate), "a noise scale estimate after 4 steps"
assert kungfu.stall_report() == "", kungfu.stall_report()

# point to point: each publishes, each fetches the next rank's (which need
# not take part); a name not published yet is waited for, within the timeout
mine = torch.full((16,), float(me))
assert kungfu.save("p2p/model", mine) == 1
assert kungfu.save("p2p/model", mine) == 2
theirs = torch.empty(16)
if n > 1:
    peer = (me + 1) % n
    assert kungfu.request(peer, "p2p/model", theirs) >= 1
    assert torch.all(theirs == peer), theirs
    for bad in (lambda: kungfu.request(me, "p2p/model", theirs),
                lambda: kungfu.request(n, "p2p/model", theirs),
                lambda: kungfu.request(peer, "p2p/model", torch.empty(15))):
        try:
            bad()
        except kungfu.KungFuError as e:
            assert e.status in (1, 3), e  # invalid argument; a size mismatch
        else:
            raise AssertionError("a bad request was accepted")
    # a size the peer did not publish: the status's own class
    try:
        kungfu.request(peer, "p2p/model", torch.empty(15))
    except kungfu.MismatchError as e:
        assert e.status == 3 and isinstance(e, kungfu.KungFuError), e
    else:
        raise AssertionError("a request of the wrong size was accepted")
    kungfu.barrier()  # every fetch is done before a store goes

for bad, call in [("strategy", lambda: kungfu.set_strategy("hypercube")),
                  ("action", lambda: kungfu.Action("teleport", 1)),
                  ("noise scale", lambda: kungfu.NoiseScale("x").update(1, 1, 8, 4))]:
    try:
        call()
    except (ValueError, kungfu.KungFuError) as e:
        assert "kungfu" in str(e), e
    else:
        raise AssertionError(f"a bad {bad} was accepted")
print(f"rank {me}: adaptation from Python ok (noise scale {estimate:.1f})", flush=True)
hvd.shutdown()
