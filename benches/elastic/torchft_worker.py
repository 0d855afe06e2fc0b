"""One replica group (of one worker) of torchft's fault-tolerant DDP, for
benches/elastic/torchft_recovery.py: a small model on generated data, torchft's
Manager, DistributedDataParallel and Optimizer wrapper, the state of a
joiner sent over the replica groups' process group (PGTransport), which
is PG=kungfu (kungfu.torch.torchft.ProcessGroupKungfu) or PG=gloo
(torchft's own ProcessGroupGloo). Run under torchrun (nproc 1) with
TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, STEPS and OUT set. Appends a line per
step to OUT/steps-<group>-<pid>.jsonl: the manager's step, the number of
participants, the time, and at the end the hash of the parameters.
"""

import hashlib
import json
import os
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

PG, GROUP = os.environ.get("PG", "kungfu"), int(os.environ["REPLICA_GROUP_ID"])
STEPS, OUT = int(os.environ["STEPS"]), os.environ["OUT"]


class Ddp(DistributedDataParallel):
    """torchft 0.2.0's comm hook asserts on the future of an allreduce that
    failed (a replica group lost mid-step: the manager has recorded the
    error and the step will not commit), which kills the survivor, on gloo
    as on kungfu. This hook hands DDP the bucket back instead, so that the
    backward pass ends and the manager discards the step."""

    @staticmethod
    def _comm_hook(state, bucket):
        work = state.allreduce(bucket.buffer())
        work.wait()
        fut = work.get_future()
        if type(fut) is torch.futures.Future:  # an errored manager's: done already
            return fut
        inner = getattr(fut, "_fut", None)
        if inner is not None:
            return inner
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


def main():
    torch.set_num_threads(1)
    if PG == "kungfu":
        from kungfu.torch.torchft import ProcessGroupKungfu

        pg = ProcessGroupKungfu(timeout=timedelta(seconds=10))
    else:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt_inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def state_dict():
        return {"model": model.state_dict(), "optim": opt_inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt_inner.load_state_dict(sd["optim"])

    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"group{GROUP}",
                      timeout=timedelta(seconds=10), hostname="127.0.0.1",
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10),
                                                       device="cpu"))
    ddp = Ddp(manager, model)
    opt = Optimizer(manager, opt_inner)
    g = torch.Generator().manual_seed(GROUP)
    log = open(os.path.join(OUT, f"steps-{GROUP}-{os.getpid()}.jsonl"), "a", buffering=1)
    while manager.current_step() < STEPS:
        x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        log.write(json.dumps({"step": manager.current_step(), "n": manager.num_participants(),
                              "t": time.time()}) + "\n")
        time.sleep(0.02)  # the rest of a step
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    log.write(json.dumps({"done": manager.current_step(), "digest": h.hexdigest(),
                          "t": time.time()}) + "\n")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
