"""One worker of the recovery benchmark (benches/elastic/recovery.py): DDP
of a 10 MB model (three linear layers, float32), each step timed, under
one of four ways of surviving a lost worker:

- `kungfu`: the kungfu backend and `kungfu.torch.elastic` under
  `kungfu-run --on-failure shrink`: the survivors see the loss in DDP's
  allreduce, agree on who is left (`kf_recover`), roll back to the last
  commit and go on, the same processes;
- `grow` (kungfu, under `kungfu-run -w`): rank 0 proposes one worker more
  at step --kill-step; the others take it in at a commit and send it the
  state (the model and the optimizer's) from live peers;
- `torchrun`: gloo under `torchrun --max-restarts`: the agent restarts
  every worker, which loads the last checkpoint (a file) and goes on;
- `gloo`: gloo with torch's reconfigure (`enable_reconfigure=True`,
  `dist._reconfigure`): the survivors' allreduce fails, they meet at a
  store the benchmark serves, reconfigure to the survivors' handles,
  reload their last commit (in memory) and go on, the same processes.

    worker.py MODE OUTDIR --kill-step K --victim V --steps S [--store HOST:PORT]

The victim SIGKILLs itself between its forward and backward passes of step
K, after writing the time to OUTDIR/killed.json. Every worker process
appends a line per event to OUTDIR/events-<pid>.jsonl: `start`, `step`
(after each optimizer step: the step, the cluster size, the time),
`failed` and `recovered` (kungfu, gloo), `changed` (grow: the commit that
took the new worker in, its start and end, and the bytes of state sent).
"""

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

DIM, HIDDEN, CLASSES, BATCH = 1024, 1024, 512, 8
COMMIT_EVERY = 5


def model_and_opt(init_sync=True):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(),
                            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                            torch.nn.Linear(HIDDEN, CLASSES))
    ddp = DDP(m, init_sync=init_sync)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)


def state_bytes(ddp, opt):
    n = sum(t.numel() * t.element_size() for t in ddp.state_dict().values())
    for st in opt.state_dict()["state"].values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


class Log:
    def __init__(self, out):
        self.f = open(out / f"events-{os.getpid()}.jsonl", "a", buffering=1)

    def __call__(self, ev, **kw):
        self.f.write(json.dumps({"ev": ev, "t": time.time(), "pid": os.getpid(), **kw}) + "\n")


def batch(step, rank):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(BATCH, DIM, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def one_step(ddp, opt, step, rank, args, out, victim):
    x, y = batch(step, rank)
    opt.zero_grad()
    loss = F.cross_entropy(ddp(x), y)
    if victim and step == args.kill_step:
        (out / "killed.json").write_text(json.dumps({"pid": os.getpid(), "at": time.time(),
                                                      "rank": rank}))
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    opt.step()


def run_kungfu(args, out, log):
    import kungfu
    from kungfu.torch import elastic
    from kungfu.torch.process_group import init_process_group

    init_process_group()
    joined = kungfu.version() > 0
    start_rank = kungfu.rank()
    log("start", rank=start_rank, size=kungfu.size(), joined=joined)
    ddp, opt = model_and_opt(init_sync=not joined)
    state = elastic.TorchState(ddp, opt)
    victim = args.mode == "kungfu" and start_rank == args.victim and not joined

    @elastic.run
    def train(state):
        grown = time.time() + 90  # grow: on until the new worker is in
        while state.step < args.steps or (args.mode == "grow" and time.time() < grown
                                           and kungfu.size() <= args.workers):
            if args.mode == "grow" and state.step == args.kill_step and kungfu.rank() == 0 \
                    and kungfu.size() == args.workers:
                kungfu.propose_new_size(args.workers + 1)
            one_step(ddp, opt, state.step, kungfu.rank(), args, out, victim)
            state.step += 1
            log("step", step=state.step, size=kungfu.size())
            if state.step % COMMIT_EVERY == 0 or args.mode == "grow":
                t0 = time.time()
                try:
                    state.commit()
                except elastic.HostsUpdatedInterrupt:
                    # the commit that took the new worker in, synced
                    log("changed", began=t0, size=kungfu.size(), **state.last_sync)
                    raise
        return state.step

    done = train(state)
    for r in state.recoveries:
        log("recovered", failed_at=r["failed_at"], recovered_at=r["recovered_at"],
            size=r["size"])
    if done is not None and args.mode == "grow":
        # the transport's bandwidth now, for the state transfer's: a
        # broadcast of as many bytes, timed the same way on every worker
        buf = torch.zeros(state_bytes(ddp, opt) // 4)
        dist.broadcast(buf, group_src=0)
        t0 = time.time()
        for _ in range(3):
            dist.broadcast(buf, group_src=0)
        log("broadcast", seconds=(time.time() - t0) / 3, bytes=buf.numel() * 4)


def run_torchrun(args, out, log):
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # gloo's keys under the restart count: with torch 2.15's env:// store
    # the restarted workers read the first attempt's addresses and fail
    # to connect (tried here)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{restart}", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    log("start", rank=rank, size=dist.get_world_size(), restart=restart)
    ddp, opt = model_and_opt()
    ckpt = out / "checkpoint.pt"
    step = 0
    if ckpt.exists():
        c = torch.load(ckpt, weights_only=False)
        ddp.load_state_dict(c["model"])
        opt.load_state_dict(c["opt"])
        step = c["step"]
    victim = restart == 0 and rank == args.victim
    while step < args.steps:
        one_step(ddp, opt, step, rank, args, out, victim)
        step += 1
        log("step", step=step, size=dist.get_world_size())
        if step % COMMIT_EVERY == 0:
            if rank == 0:
                tmp = out / f"checkpoint.{os.getpid()}.pt"
                torch.save({"model": ddp.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, ckpt)
            dist.barrier()
    dist.destroy_process_group()


def run_gloo(args, out, log):
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=size, timeout=timedelta(seconds=30),
                            enable_reconfigure=True)
    log("start", rank=rank, size=size)
    def meet(round_, expect):
        """The survivors' out-of-band meeting: each posts its handle (gloo's
        changes with each reconfigure); all take the first `expect` in
        order of their first rank."""
        store.set(f"r{round_}/{rank}", dist._get_reconfigure_handle())
        store.add(f"r{round_}/n", 1)
        while int(store.add(f"r{round_}/n", 0)) < expect:
            time.sleep(0.005)
        hs = []
        for r in range(size):
            if store.check([f"r{round_}/{r}"]):
                hs.append(store.get(f"r{round_}/{r}").decode())
        return hs

    dist._reconfigure(1, meet(1, size), timeout=timedelta(seconds=30)).wait()
    ddp, opt = model_and_opt()
    victim = rank == args.victim
    step, saved, rounds = 0, None, 1
    while step < args.steps:
        if step % COMMIT_EVERY == 0:
            saved = (step, {k: v.clone() for k, v in ddp.state_dict().items()},
                     opt.state_dict())
        try:
            one_step(ddp, opt, step, dist.get_rank(), args, out, victim)
        except RuntimeError as e:
            failed_at = time.time()
            log("failed", error=str(e)[:300])
            rounds += 1
            dist._reconfigure(rounds, meet(rounds, size - 1), timeout=timedelta(seconds=30)).wait()
            ddp._update_process_group(dist.distributed_c10d._get_default_group())
            step, model, o = saved
            ddp.load_state_dict(model)
            opt.load_state_dict(o)
            log("recovered", failed_at=failed_at, recovered_at=time.time(),
                size=dist.get_world_size())
            continue
        step += 1
        log("step", step=step, size=dist.get_world_size())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["kungfu", "grow", "torchrun", "gloo"])
    p.add_argument("out", type=Path)
    p.add_argument("--kill-step", type=int, default=10)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=4, help="how many start")
    p.add_argument("--store", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    log = Log(args.out)
    {"kungfu": run_kungfu, "grow": run_kungfu, "torchrun": run_torchrun,
     "gloo": run_gloo}[args.mode](args, args.out, log)
    sys.exit(0)


if __name__ == "__main__":
    main()
