"""kungfu.torch.optimizers and the monitors inside the exchange
(argv: MODE OUTDIR).

`optim`: S-SGD, SMA (alpha 0.3) and pair averaging (a fixed peer
schedule) train a small model for a few steps on data that differs by
rank; each rank replays the whole cluster in one process with the same
formula (for pair averaging: with the versions of the peers' models it
actually got, which timing decides) and compares its parameters.

`noise`: a problem whose per-sample gradient is `G + sigma * noise`, so
that the true noise scale is `d sigma^2 / |G|^2`: the noise-scale
monitor of MonitorGradientNoiseScaleOptimizer, and of DDP's
`kungfu.torch.hooks.noise_scale_hook`, must be within 20% of it; and the
per-peer counters must show as many ops per step with the monitor as
without it.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import kungfu
import kungfu.torch as kt
from kungfu.torch import hooks, optimizers as O

MODE, OUT = sys.argv[1], Path(sys.argv[2])
kt.init()
me, n = kungfu.rank(), kungfu.size()
result = {}


def data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def fresh_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def grads(model, step, rank):
    model.zero_grad()
    x, y = data(step, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a.parameters(), b.parameters()))


STEPS = 6


def run(make, steps=STEPS):
    model = fresh_model()
    opt = make(sgd(model), model.named_parameters())
    got = []
    for step in range(steps):
        grads(model, step, me)
        opt.step()
        got.append(list(getattr(opt, "_kf_got", [])))
    return model, opt, got


if MODE == "optim":
    # S-SGD: one model, the mean gradient
    model, _, _ = run(O.SynchronousSGDOptimizer)
    ref = fresh_model()
    ref_opt = sgd(ref)
    for step in range(STEPS):
        mean = [sum(gs) / n for gs in zip(*[grads(ref, step, r) for r in range(n)])]
        for p, g in zip(ref.parameters(), mean):
            p.grad = g
        ref_opt.step()
    result["ssgd"] = max_diff(model, ref)

    # SMA: every model moves towards the mean by alpha, then its own gradient
    alpha = 0.3
    model, _, _ = run(lambda o, np_: O.SynchronousAveragingOptimizer(o, np_, alpha=alpha))
    refs = [fresh_model() for _ in range(n)]
    ref_opts = [sgd(m) for m in refs]
    for step in range(STEPS):
        gs = [grads(refs[r], step, r) for r in range(n)]
        means = [sum(ps) / n for ps in zip(*[[p.data.clone() for p in m.parameters()]
                                            for m in refs])]
        for r in range(n):
            with torch.no_grad():
                for p, mu, g in zip(refs[r].parameters(), means, gs[r]):
                    p.mul_(1 - alpha).add_(mu, alpha=alpha)
                    p.grad = g
            ref_opts[r].step()
    result["sma"] = max_diff(model, refs[me])

    # pair averaging, peer (rank + 1 + step) % n skipping itself; each rank
    # records the version of the peer's model it got at each step
    def peer_of(rank, step):
        p = (rank + 1 + step) % n
        return p if p != rank else (p + 1) % n

    model, opt, got = run(lambda o, np_: O.PairAveragingOptimizer(
        o, np_, peer_selector=lambda step: peer_of(me, step)))
    everyone = kt.allgather_object(got)
    # replay: models[r][v] is rank r's model at version v (1: the initial one)
    models = {r: {1: [p.data.clone() for p in fresh_model().parameters()]} for r in range(n)}
    replay = [fresh_model() for _ in range(n)]
    ropts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in replay]
    pending = {r: 0 for r in range(n)}
    progress = True
    while progress and any(pending[r] < STEPS for r in range(n)):
        progress = False
        for r in range(n):
            t = pending[r]
            if t >= STEPS:
                continue
            fetched = everyone[r][t]
            if not all(v in models[p] for p, v in fetched):
                continue
            g = grads(replay[r], t, r)
            with torch.no_grad():
                for p_, v in fetched:
                    for p, q in zip(replay[r].parameters(), models[p_][v]):
                        p.add_(q).mul_(0.5)
            for p, gg in zip(replay[r].parameters(), g):
                p.grad = gg
            ropts[r].step()
            models[r][t + 2] = [p.data.clone() for p in replay[r].parameters()]
            pending[r] = t + 1
            progress = True
    assert all(pending[r] == STEPS for r in range(n)), ("the versions got form a cycle", everyone)
    result["pair"] = max_diff(model, replay[me])
    result["pair_peers"] = [[p for p, _ in step] for step in got]

elif MODE == "noise":
    D, SIGMA, BATCH = 64, 1.0, 16
    G = torch.full((D,), 0.25)  # |G|^2 = 4
    truth = D * SIGMA ** 2 / float(G.pow(2).sum())

    class Probe(torch.nn.Module):
        """loss = mean_i w . x_i, so the gradient is the mean of the x_i."""

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(D))

        def forward(self, x):
            return (x @ self.w).mean()

    def batch(step, rank):
        g = torch.Generator().manual_seed(7919 * step + rank)
        return G + SIGMA * torch.randn(BATCH, D, generator=g)

    def train(opt, model, steps, first=0):
        for step in range(first, first + steps):
            opt.zero_grad()
            model(batch(step, me)).backward()
            opt.step()

    def ops_per_peer(make, steps=40):
        model = Probe()
        opt = make(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters())
        kungfu.reset_stats()
        train(opt, model, steps)
        return [s["ops"] for r, s in enumerate(kungfu.peer_stats()) if r != me]

    plain = ops_per_peer(O.SynchronousSGDOptimizer)
    watched = ops_per_peer(lambda o, np_: O.MonitorGradientNoiseScaleOptimizer(
        o, np_, device_batch_size=BATCH, alpha=0.01))
    result["ops_plain"], result["ops_monitored"] = plain, watched

    model = Probe()
    opt = O.MonitorGradientNoiseScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                               model.named_parameters(),
                                               device_batch_size=BATCH, alpha=0.01)
    train(opt, model, 1500)
    result["truth"] = truth
    result["optimizer"] = O.monitor_of(opt).noise_scale

    # DDP with the comm hook, on the "kungfu" backend
    dist.init_process_group("kungfu")
    model = Probe()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = hooks.MonitorState(device_batch_size=BATCH, alpha=0.01)
    ddp.register_comm_hook(state, hooks.noise_scale_hook)
    sgd0 = torch.optim.SGD(ddp.parameters(), lr=0.0)
    for step in range(1500):
        sgd0.zero_grad()
        x = batch(step, me)
        ddp(x).backward()
        if step == 0:
            mean = sum(batch(0, r).mean(0) for r in range(n)) / n
            result["ddp_grad_err"] = float((model.w.grad - mean).abs().max())
    result["ddp"] = state.monitor.noise_scale
    dist.destroy_process_group()

(OUT / f"{MODE}-rank{me}.json").write_text(json.dumps(result))
print(f"optim worker rank {me}: {MODE} done: {result}", flush=True)
