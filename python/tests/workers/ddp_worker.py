"""DistributedDataParallel training of model.SmallCNN on one backend.

    kungfu-run -np N python ddp_worker.py BACKEND OUTDIR STEPS BUCKET_MB

Each rank starts from a model of its own seed (DDP's first broadcast makes
them rank 0's), trains STEPS steps of SGD with momentum on its own batches,
and writes OUTDIR/<BACKEND>-rank<R>.json (its loss at each step, the SHA-256
of its final parameters, whether every rank's parameters are equal bit for
bit, gathered over the backend itself) and OUTDIR/<BACKEND>-rank<R>.pt (the
final parameters, flattened).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import kungfu.torch  # noqa: F401  registers "kungfu"
from model import flat_params, make_model, save_result, train


def main():
    backend, outdir, steps, bucket_mb = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=rank)
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = train(ddp, opt, rank, steps)
    log = ddp._get_ddp_logging_data()
    flat = flat_params(model)
    every = torch.zeros(size * flat.numel(), dtype=flat.dtype)
    dist.all_gather_into_tensor(every, flat)
    every = every.view(size, -1)
    equal = all(torch.equal(every[0], every[r]) for r in range(size))
    digest = save_result(outdir, backend, rank, size, losses, flat, equal,
                         numel=flat.numel(), bucket_cap_mb=bucket_mb,
                         bucket_sizes=str(log.get("bucket_sizes")),
                         rebuilt_bucket_sizes=str(log.get("rebuilt_bucket_sizes")))
    print(f"rank {rank}: {backend}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, params {digest[:16]}",
          flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
