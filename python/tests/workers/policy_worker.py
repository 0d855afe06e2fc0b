"""Policies through kungfu.torch.policy (argv: MODE OUTDIR).

`agree` (kungfu-run -np 3): one rank proposes at a time, at steps that
differ by rank (a strategy, a batch size, a learning rate, two sync
changes), and at step 7 the ranks disagree (rank 0 against ranks 1 and
2). Every rank writes what it applied at every step.

`sampler` (kungfu-run -w -np 2): 97 samples, 3 epochs; the batch size
changes at steps 3 and 14, the cluster grows to 3 at step 5 and shrinks to
2 at step 9. Every process (the one that joins and leaves too) writes the
indices of every batch it was given, by epoch.
"""

import json
import os
import sys
from pathlib import Path

import torch

import kungfu
from kungfu.torch.optimizers import SynchronousSGDOptimizer
from kungfu.torch.policy import BasePolicy, PolicyRunner

MODE, OUT = sys.argv[1], Path(sys.argv[2])
torch.manual_seed(0)


class OneRankAtATime(BasePolicy):
    def after_step(self, ctx):
        r, s = ctx.rank, ctx.step
        if r == 0 and s == 2:
            ctx.set_strategy("ring")
        if r == 1 and s == 3:
            ctx.set_batch_size(3)
        if r == 2 and s == 4:
            ctx.set_learning_rate(0.05)
        if r == 1 and s == 5:
            ctx.set_sync("sma")
        if r == 2 and s == 6:
            ctx.set_sync("ssgd")
        if s == 7:
            ctx.set_batch_size(4 if r == 0 else 5)


class Elastic(BasePolicy):
    def after_step(self, ctx):
        if ctx.rank != 0:
            return
        if ctx.step == 3:
            ctx.set_batch_size(6)
        if ctx.step == 5:
            ctx.resize(3)
        if ctx.step == 9:
            ctx.resize(2)
        if ctx.step == 14:
            ctx.set_batch_size(3)


if MODE == "agree":
    data = torch.utils.data.TensorDataset(torch.arange(150.0).unsqueeze(1), torch.zeros(150, 1))
    policies, epochs, batch = [OneRankAtATime()], 1, 2
else:
    data = torch.utils.data.TensorDataset(torch.arange(97).unsqueeze(1).float(),
                                          torch.arange(97))
    policies, epochs, batch = [Elastic()], 3, 4

model = torch.nn.Linear(1, 1)
opt = SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              model.named_parameters())
runner = PolicyRunner(policies, model=model, optimizer=opt, dataset=data, batch_size=batch,
                      epochs=epochs, seed=3)
steps, seen = [], []
for x, y in runner:
    steps.append({"step": runner.context.step, "batch": len(x), "size": kungfu.size(),
                  "lr": opt.param_groups[0]["lr"], "sync": opt.sync})
    if MODE == "sampler":
        seen.append([runner.context.epoch, [int(i) for i in y]])
    loss = ((model(x) - x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    runner.record("loss", float(loss))
    if MODE == "agree" and runner.context.step >= 1:
        assert runner.context.metrics["loss"] == float(loss)
        # known peers only, each with a rate (none while the fast path,
        # which does not count per peer, carries every op)
        rates = runner.context.metrics["peer_rates"]
        assert kungfu.rank() not in rates and all(v > 0 for v in rates.values()), rates

history = [[s, a.kind, a.value, a.custom_kind] for s, a in runner.history]
name = f"rank{kungfu.rank()}" if MODE == "agree" else f"pid{os.getpid()}"
(OUT / f"{MODE}-{name}.json").write_text(json.dumps(
    {"steps": steps, "history": history, "seen": seen, "detached": runner.detached}))
print(f"policy worker {os.getpid()}: {MODE} done, {len(steps)} batches, detached "
      f"{runner.detached}", flush=True)
