"""Data-parallel training of model.TinyTransformer with DEEP_LAYERS
layers (207 parameter tensors) on one of:

    kungfu-run -np N python deep_worker.py ddp-gloo OUTDIR STEPS
    kungfu-run -np N python deep_worker.py hvd OUTDIR STEPS [FUSION_BYTES]

`ddp-gloo`: DDP over gloo, the reference. `hvd`: kungfu.torch's
DistributedOptimizer, which fuses the gradients into buckets of
KUNGFU_FUSION_BYTES (FUSION_BYTES, if given, sets it). Both start from
one seed and train STEPS steps of SGD with momentum on each rank's
batches, averaging the gradients; writes OUTDIR/<MODE>-rank<R>.json and
.pt as model.save_result (with the number of parameter tensors and, for
hvd, of fusion buckets).
"""

import os
import sys
from pathlib import Path

import torch

from model import DEEP_LAYERS, flat_params, make_transformer, save_result, token_batches, token_loss


def main():
    mode, outdir, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if len(sys.argv) > 4:
        os.environ["KUNGFU_FUSION_BYTES"] = sys.argv[4]
    torch.set_num_threads(1)
    model = make_transformer(DEEP_LAYERS, seed=0)
    extra = {"tensors": len(list(model.parameters()))}
    if mode == "ddp-gloo":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        forward = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def gather(flat):
            every = torch.zeros(size * flat.numel())
            dist.all_gather_into_tensor(every, flat)
            return every.view(size, -1)
    elif mode == "hvd":
        import kungfu.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        forward = model
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(), op=hvd.Average)
        extra["buckets"] = len(opt._buckets)

        def gather(flat):
            return hvd.allgather(flat.unsqueeze(0), name="final-params")
    else:
        sys.exit(f"unknown mode {mode}")
    losses = []
    for x, y in token_batches(rank, steps):
        opt.zero_grad()
        loss = token_loss(forward, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = flat_params(model)
    every = gather(flat)
    equal = all(torch.equal(every[0], every[r]) for r in range(size))
    digest = save_result(outdir, mode, rank, size, losses, flat, equal, **extra)
    print(f"rank {rank}: {mode}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {extra}, "
          f"params {digest[:16]}", flush=True)


if __name__ == "__main__":
    main()
