"""DDP that trains on through a lost worker and its replacement, with no
restart of the others, under `kungfu-run -np 4 --on-failure replace`.

    kungfu-run -np 4 --on-failure replace python elastic_ddp.py OUTDIR VICTIM KILL_STEP

The worker that started as rank VICTIM SIGKILLs itself at step KILL_STEP,
between its forward and backward passes, so that the others are waiting
in DDP's gradient allreduce. They see the loss there (`run` recovers:
the cluster shrinks to 3, each rolls back to the last commit, a commit
every 2 steps), train on as 3; kungfu-run starts a replacement, which
the others take in at their next commit and which gets the model, the
optimizer's state, the sampler's and the log from them. Every committed
step logs its global batch (the samples of every worker): the log goes
back with a rollback, so it holds what the model was trained on.

Each worker that finishes writes OUTDIR/final-<pid>.json: how it started
(rank, joined or not), its rank and size at the end, the hash of its
parameters and optimizer state, the log and its recoveries. Each writes
OUTDIR/start-<pid>.json when it starts; the victim writes
OUTDIR/killed.json (its pid and the time) just before it dies.
"""

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import kungfu
from kungfu.torch import elastic
from kungfu.torch.process_group import init_process_group

OUT = Path(sys.argv[1])
VICTIM, KILL_STEP = int(sys.argv[2]), int(sys.argv[3])
EPOCHS, BATCH, N, DIM, CLASSES = 2, 4, 120, 16, 4

kungfu.init()
torch.set_num_threads(1)
init_process_group()
START_RANK, JOINED = kungfu.rank(), kungfu.version() > 0
(OUT / f"start-{os.getpid()}.json").write_text(json.dumps(
    {"rank": START_RANK, "joined": JOINED, "pid": os.getpid(), "size": kungfu.size()}))

g = torch.Generator().manual_seed(3)
X, Y = torch.randn(N, DIM, generator=g), torch.randint(0, CLASSES, (N,), generator=g)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, CLASSES))
# a joiner's DDP module runs no collective when made: the others are not
# making one; run's first sync gives it the model
ddp = DDP(model, init_sync=not JOINED)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
sampler = elastic.ElasticSampler(list(range(N)), shuffle=True, seed=1)
state = elastic.TorchState(ddp, opt, epoch=0, sampler=sampler, log=[])


@elastic.run
def train(state):
    while state.epoch < EPOCHS:
        batch = sampler.next_batch(BATCH)
        if not batch:
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            continue
        me, n = kungfu.rank(), kungfu.size()
        mine = batch[me::n]
        opt.zero_grad()
        loss = F.cross_entropy(ddp(X[mine]), Y[mine])
        if START_RANK == VICTIM and not JOINED and state.step == KILL_STEP:
            (OUT / "killed.json").write_text(json.dumps({"pid": os.getpid(), "rank": me,
                                                         "at": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        sampler.advance(batch)
        state.step += 1
        state.log = state.log + [[state.epoch, state.step, n, sorted(batch)]]
        if state.step % 2 == 0:
            state.commit()
    # A short job may end before the replacement is up: wait for it (at
    # commits, where it is taken in), so that it is checked too.
    deadline = time.time() + 90
    while kungfu.size() < 4 and time.time() < deadline:
        time.sleep(0.2)
        state.commit()
    return state.step


def digest():
    h = hashlib.sha256()
    for t in ddp.state_dict().values():
        h.update(t.detach().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        h.update(st["momentum_buffer"].numpy().tobytes())
    return h.hexdigest()


steps = train(state)
if steps is not None:
    (OUT / f"final-{os.getpid()}.json").write_text(json.dumps({
        "start_rank": START_RANK, "joined": JOINED, "pid": os.getpid(), "rank": kungfu.rank(),
        "size": kungfu.size(), "steps": steps, "digest": digest(), "log": state.log,
        "recoveries": state.recoveries}))
    print(f"elastic ddp: start rank {START_RANK} (joined {JOINED}): rank {kungfu.rank()} of "
          f"{kungfu.size()} finished {steps} steps", flush=True)
