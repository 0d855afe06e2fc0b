"""Horovod-style training of model.SmallCNN with kungfu.torch's
DistributedOptimizer (the same steps as ddp_worker.py, which DDP on gloo
is the reference for):

    kungfu-run -np N python hvd_optimizer_worker.py OUTDIR STEPS

Writes OUTDIR/hvd-rank<R>.json and .pt as ddp_worker.py does."""

import sys
from pathlib import Path

import torch

import kungfu.torch as hvd
from model import flat_params, make_model, save_result, train


def main():
    outdir, steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = make_model(seed=rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   op=hvd.Average)
    losses = train(model, opt, rank, steps)
    flat = flat_params(model)
    every = hvd.allgather(flat.unsqueeze(0), name="final-params")
    equal = all(torch.equal(every[0], every[r]) for r in range(size))
    digest = save_result(outdir, "hvd", rank, size, losses, flat, equal)
    print(f"rank {rank}: DistributedOptimizer: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"params {digest[:16]}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
