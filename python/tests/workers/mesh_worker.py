"""A 2x2 DeviceMesh over one backend: data parallel on the mesh's "dp"
axis, the model split on its "tp" axis (tensor parallel: fc1 column-wise,
fc2 row-wise, DTensor's ColwiseParallel and RowwiseParallel), against the
same model trained on the whole batch in one process.

    kungfu-run -np 4 python mesh_worker.py BACKEND OUTDIR STEPS

Every rank builds the model from one seed. A step: each "dp" row of the
mesh takes its half of the batch; the "tp" pair splits fc1's outputs and
fc2's inputs between them (their collectives run in the "tp" subgroup);
then the gradients of each shard are averaged over the "dp" subgroup, and
SGD steps. Each rank also trains the whole model alone on the whole
batches (the reference) and writes OUTDIR/<BACKEND>-rank<R>.json: the
mesh's mean losses, the reference's, the largest difference between the
full parameters (gathered from the shards) and the reference's, and the
shapes of its shards.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, parallelize_module,
)

import kungfu.torch  # noqa: F401  registers "kungfu"
from model import fit

BATCH, DIM, HIDDEN, OUT = 16, 12, 32, 6


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def make_model():
    torch.manual_seed(0)
    return MLP()


def batches(steps):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, DIM, generator=g), torch.randint(0, OUT, (BATCH,), generator=g))
            for _ in range(steps)]


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def main():
    backend, outdir, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    assert dist.get_world_size() == 4, "a 2x2 mesh"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    data = batches(steps)

    ref = make_model()
    ref_losses = fit(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data)

    model = parallelize_module(make_model(), tp,
                               {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    half = BATCH // 2
    lo = dp.get_local_rank() * half
    dp_group = dp.get_group()
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x[lo:lo + half]), y[lo:lo + half])
        loss.backward()
        for p in model.parameters():
            g = local(p.grad)
            dist.all_reduce(g, group=dp_group)
            g.div_(dp.size())
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        losses.append(mean.item() / dp.size())

    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in model.named_parameters()}
    diff = max((full[n] - r.detach()).abs().max().item() for n, r in ref.named_parameters())
    shards = {n: list(local(p).shape) for n, p in model.named_parameters()}
    out = outdir / f"{backend}-rank{rank}.json"
    out.write_text(json.dumps({"losses": losses, "ref_losses": ref_losses, "param_diff": diff,
                               "shards": shards, "dp": dp.get_local_rank(),
                               "tp": tp.get_local_rank()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
