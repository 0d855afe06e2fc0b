"""DistributedDataParallel that trains on through a lost worker, without
restarting the others (CPU, generated data):

    kungfu-run -np 4 --on-failure shrink   python examples/torch/elastic_ddp.py --kill-rank 2 --kill-step 5
    kungfu-run -np 4 --on-failure replace  python examples/torch/elastic_ddp.py --kill-rank 2 --kill-step 5

The worker that started as `--kill-rank` SIGKILLs itself at step
`--kill-step` (a crash, a lost host). The others see it in DDP's gradient
allreduce (naming the lost rank), agree on who is left, roll back to their
last commit and go on as 3, the same processes. With `replace`, kungfu-run
starts a new worker, which the others take in at the first commit after
it connected (they do not wait for it: a job shorter than its start, a
few seconds here, ends without it) and which gets the model, the
optimizer's state and the sampler's from them over the library (no
checkpoint file). Every sample of an epoch is trained on once
across the change; at the end every worker checks that its parameters are
rank 0's, bit for bit.
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import kungfu
from kungfu.torch import elastic
from kungfu.torch.process_group import init_process_group


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="samples per worker per step")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=5)
    args = p.parse_args()

    torch.set_num_threads(1)
    init_process_group()  # the "kungfu" backend, rank and size from the library
    joined = kungfu.version() > 0  # started by kungfu-run to replace a lost worker
    start_rank = kungfu.rank()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long()  # a learnable task
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    # a joiner's DDP runs no collective when made (the others are not
    # making one); elastic.run's first sync gives it the model
    ddp = DDP(model, init_sync=not joined)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    sampler = elastic.ElasticSampler(range(len(x)), shuffle=True, seed=1)
    state = elastic.TorchState(ddp, opt, epoch=0, sampler=sampler)

    @elastic.run
    def train(state):
        while state.epoch < args.epochs:
            batch = sampler.next_batch(args.batch)  # every worker's samples
            if not batch:
                if kungfu.rank() == 0:
                    print(f"epoch {state.epoch}: loss {loss.item():.3f} on "
                          f"{kungfu.size()} workers", flush=True)
                state.epoch += 1
                sampler.set_epoch(state.epoch)
                state.commit()
                continue
            mine = batch[kungfu.rank()::kungfu.size()]
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x[mine]), y[mine])
            if start_rank == args.kill_rank and not joined and state.step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()  # a lost peer raises here: run recovers
            opt.step()
            sampler.advance(batch)
            state.step += 1
            if state.step % 4 == 0:
                state.commit()  # a rollback point; takes in a replacement
        return state.step

    steps = train(state)
    if steps is None:
        return  # this worker was left out
    mine = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    first = mine.clone()
    dist.broadcast(first, group_src=0)
    same = torch.equal(mine, first)
    print(f"start rank {start_rank} (pid {os.getpid()}): rank {kungfu.rank()} of "
          f"{kungfu.size()}, {steps} steps, {len(state.recoveries)} recoveries; "
          f"parameters {'equal' if same else 'DIFFER from'} rank 0's", flush=True)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
