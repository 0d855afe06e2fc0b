"""DDP or FSDP2 that trains on through lost workers and their replacements,
with no restart of the others, under `kungfu-run -np 4 --on-failure
replace`.

    kungfu-run -np 4 --on-failure replace python elastic_torch.py OUTDIR MODE VICTIMS KILL_STEP [stop]

MODE is `ddp` (DistributedDataParallel) or `fsdp` (fully_shard of each
layer and the root over a mesh of every worker, made again by the state's
`rebuild` after each change). The workers that started as the ranks in
VICTIMS (comma-separated) SIGKILL (`stop`: SIGSTOP) themselves at step
KILL_STEP, between
their forward and backward passes, so that the others are waiting in a
collective of the backward pass. They see the loss there (`run`
recovers: the cluster shrinks, each rolls back to the last commit, a
commit every 2 steps), train on; kungfu-run starts replacements, which
the others take in at a commit and which get the model, the optimizer's
state, the sampler's and the log from them. Every committed step logs its
global batch (the samples of every worker): the log goes back with a
rollback, so it holds what the model was trained on.

Each worker that finishes writes OUTDIR/final-<pid>.json: how it started
(rank, joined or not), its rank and size at the end, the hash of the
whole model and optimizer state, the log and its recoveries. Each writes
OUTDIR/start-<pid>.json when it starts; a victim writes
OUTDIR/killed-<rank>.json (its pid, rank then and the time) just before
it dies.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import kungfu
from kungfu.torch import elastic
from kungfu.torch.elastic.fsdp import full_state
from kungfu.torch.process_group import init_process_group

OUT, MODE = Path(sys.argv[1]), sys.argv[2]
VICTIMS, KILL_STEP = [int(v) for v in sys.argv[3].split(",")], int(sys.argv[4])
# how a victim goes: SIGKILL (its connections close at once) or SIGSTOP
# (frozen: only the heartbeats' silence tells)
SIGNAL = signal.SIGSTOP if len(sys.argv) > 5 and sys.argv[5] == "stop" else signal.SIGKILL
EPOCHS, BATCH, N, DIM, CLASSES = 2, 4, 120, 16, 4

kungfu.init()
torch.set_num_threads(1)
init_process_group()
START_RANK, JOINED = kungfu.rank(), kungfu.version() > 0
(OUT / f"start-{os.getpid()}.json").write_text(json.dumps(
    {"rank": START_RANK, "joined": JOINED, "pid": os.getpid(), "size": kungfu.size()}))

g = torch.Generator().manual_seed(3)
X, Y = torch.randn(N, DIM, generator=g), torch.randint(0, CLASSES, (N,), generator=g)


def layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, CLASSES))


def build_fsdp():
    """The model sharded over every worker of the cluster now, and its
    optimizer (the state's `rebuild`)."""
    model = layers()
    mesh = init_device_mesh("cpu", (kungfu.size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


sampler = elastic.ElasticSampler(list(range(N)), shuffle=True, seed=1)
if MODE == "ddp":
    # a joiner's DDP module runs no collective when made: the others are
    # not making one; run's first sync gives it the model
    model = DDP(layers(), init_sync=not JOINED)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = elastic.TorchState(model, opt, epoch=0, sampler=sampler, log=[])
else:
    model, opt = build_fsdp()
    state = elastic.TorchState(model, opt, rebuild=build_fsdp, epoch=0, sampler=sampler, log=[])


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
        state.optimizer.zero_grad()
        loss = F.cross_entropy(state.model(X[mine]), Y[mine])
        if START_RANK in VICTIMS and not JOINED and state.step == KILL_STEP:
            (OUT / f"killed-{START_RANK}.json").write_text(json.dumps(
                {"pid": os.getpid(), "rank": me, "at": time.time()}))
            os.kill(os.getpid(), SIGNAL)
        loss.backward()
        state.optimizer.step()
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
    """The whole model and optimizer state's hash (a collective in fsdp)."""
    msd, osd = full_state(state.model, state.optimizer)
    h = hashlib.sha256()
    for k in sorted(msd):
        h.update(msd[k].numpy().tobytes())
    for k in sorted(osd["state"]):
        h.update(osd["state"][k]["momentum_buffer"].numpy().tobytes())
    return h.hexdigest()


steps = train(state)
if steps is not None:
    (OUT / f"final-{os.getpid()}.json").write_text(json.dumps({
        "start_rank": START_RANK, "joined": JOINED, "pid": os.getpid(), "rank": kungfu.rank(),
        "size": kungfu.size(), "steps": steps, "digest": digest(), "log": state.log,
        "recoveries": state.recoveries}))
    print(f"elastic {MODE}: start rank {START_RANK} (joined {JOINED}): rank {kungfu.rank()} of "
          f"{kungfu.size()} finished {steps} steps", flush=True)
