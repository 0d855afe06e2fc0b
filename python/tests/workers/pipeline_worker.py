"""A 2-stage pipeline (torch.distributed.pipelining, GPipe) of a small MLP
over one backend, against the same model trained in one process.

    kungfu-run -np 2 python pipeline_worker.py BACKEND OUTDIR STEPS

Both ranks build the whole model from one seed; rank 0 runs its first half,
rank 1 its second half and the loss. Activations go forward and gradients
back by the backend's send/recv (isend/irecv, batch_isend_irecv). Each
step is 4 microbatches of 4 samples, then SGD. Each rank also trains the
whole model alone on the same batches (the reference), and writes
OUTDIR/<BACKEND>-rank<R>.json: the pipeline's losses (rank 1) and the
reference's, and the largest difference between its half of the
pipelined model's parameters and the same half of the reference's.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import kungfu.torch  # noqa: F401  registers "kungfu"
from model import fit

BATCH, MICRO, DIM = 16, 4, 24


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),  # stage 0
        nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10),              # stage 1
    )


def halves(model):
    return nn.Sequential(*model[:4]), nn.Sequential(*model[4:])


def batches(steps):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, DIM, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(steps)]


def main():
    backend, outdir, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    assert size == 2, "a 2-stage pipeline"
    data = batches(steps)

    # the reference: the whole model in this process
    ref = make_model()
    ref_losses = fit(ref, torch.optim.SGD(ref.parameters(), lr=0.05), data)

    # the pipeline: this rank's half
    part = halves(make_model())[rank]
    stage = PipelineStage(part, rank, size, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    losses = []
    for x, y in data:
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            mb = []
            schedule.step(target=y, losses=mb)
            losses.append(float(torch.stack(mb).mean()))
        opt.step()

    mine = halves(ref)[rank]
    diff = max(float((a - b).abs().max()) for a, b in zip(part.parameters(), mine.parameters()))
    (outdir / f"{backend}-rank{rank}.json").write_text(json.dumps({
        "rank": rank, "backend": backend, "losses": losses, "ref_losses": ref_losses,
        "param_diff": diff}))
    print(f"rank {rank}: {backend}: param diff {diff:.3g}"
          + (f", loss {losses[0]:.4f} -> {losses[-1]:.4f} (one process: "
             f"{ref_losses[0]:.4f} -> {ref_losses[-1]:.4f})" if losses else ""), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
