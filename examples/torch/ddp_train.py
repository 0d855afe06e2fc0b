"""DistributedDataParallel training of a small CNN with the "kungfu"
torch.distributed backend, on generated data (CPU):

    kungfu-run -np 4 python examples/torch/ddp_train.py [--backend gloo] [--steps N]
    torchrun --standalone --nproc_per_node 4 examples/torch/ddp_train.py
    mpirun -np 4 python examples/torch/ddp_train.py   # or srun

Each rank trains on its own shard of a generated, learnable task (the class
is which quadrant of a 16x16 image is a little brighter); DDP allreduces the
gradients through the backend, bucket by bucket, while backward runs. At the
end every rank checks that its parameters equal rank 0's, bit for bit.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kungfu.torch  # noqa: F401  (registers the "kungfu" backend)
from kungfu.torch.process_group import init_process_group


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def batch(gen, n):
    x = torch.rand(n, 1, 16, 16, generator=gen)
    quad = torch.randint(0, 4, (n,), generator=gen)
    for i, q in enumerate(quad.tolist()):
        r, c = divmod(q, 2)
        x[i, 0, r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 0.08
    return x, quad


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="kungfu")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()

    if args.backend == "kungfu" and "MASTER_ADDR" not in os.environ:
        init_process_group()  # mpirun, srun: rank and size from the library
    else:
        dist.init_process_group(args.backend)  # env:// (kungfu-run, torchrun)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model everywhere
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    t0 = time.time()
    for step in range(1, args.steps + 1):
        x, y = batch(gen, args.batch)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == 1:
            avg = loss.detach().clone()
            dist.all_reduce(avg)  # gloo has no AVG
            if rank == 0:
                print(f"step {step:3d}  loss {avg.item() / size:.4f} (rank 0: {loss.item():.4f})", flush=True)
    elapsed = time.time() - t0

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    same = torch.tensor([int(torch.equal(flat, ref))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{args.backend}: {size} ranks, {args.steps} steps in {elapsed:.1f} s; "
              f"parameters {'identical' if same.item() else 'DIFFERENT'} on all ranks", flush=True)
    dist.destroy_process_group()
    raise SystemExit(0 if same.item() else 1)


if __name__ == "__main__":
    main()
