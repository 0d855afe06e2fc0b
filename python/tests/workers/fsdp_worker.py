"""FSDP2 (torch.distributed.fsdp.fully_shard) training of a small
transformer on one backend.

    kungfu-run -np N python fsdp_worker.py BACKEND OUTDIR STEPS

Every rank builds the model from one seed (FSDP2 shards what each rank
holds: the ranks must start equal), shards each encoder layer and the
root over the whole world, trains STEPS steps of SGD on batches of its
own (the gradients are reduce-scattered, the parameters all-gathered
before each forward and backward), and writes OUTDIR/<BACKEND>-rank<R>.json
(its loss at each step, the SHA-256 of the full final parameters, and
whether the ranks' full parameters are equal) and .pt (those parameters,
flattened), as model.save_result.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import kungfu.torch  # noqa: F401  registers "kungfu"
from model import TinyTransformer, save_result, token_batches, token_loss

def main():
    backend, outdir, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    # SGD, not Adam: Adam divides each gradient by its own running size, so
    # a near-zero gradient summed in another order (gloo's and kungfu's
    # reduce-scatters differ in the last bits) moves its parameter by up
    # to the whole learning rate, and the backends' parameters could not
    # be compared
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in token_batches(rank, steps):
        opt.zero_grad()
        loss = token_loss(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the full parameters (an all-gather of each shard)
    flat = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    every = torch.zeros(size * flat.numel(), dtype=flat.dtype)
    dist.all_gather_into_tensor(every, flat)
    every = every.view(size, -1)
    equal = all(torch.equal(every[0], every[r]) for r in range(size))
    shards = sum(p.to_local().numel() for p in model.parameters())
    digest = save_result(outdir, backend, rank, size, losses, flat, equal,
                         numel=flat.numel(), local_numel=shards)
    print(f"rank {rank}: {backend}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"{shards} of {flat.numel()} parameters here, params {digest[:16]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
