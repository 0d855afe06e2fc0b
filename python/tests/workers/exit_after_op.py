"""Ends the interpreter right after ops complete, without finalizing the
library: whatever the library's threads still hold of the ops must not
touch Python while it exits (that was a `terminate called without an
active exception` abort in about one exit of three)."""

import torch
import torch.distributed as dist

import kungfu.torch  # noqa: F401

dist.init_process_group("kungfu")
out = [torch.zeros(4) for _ in range(dist.get_world_size())]
dist.all_gather(out, torch.ones(4))
dist.all_reduce(torch.ones(1000))  # a temporary: the op holds its last reference
dist.all_reduce(torch.ones(8), async_op=True).wait()
print(f"rank {dist.get_rank()}: exiting", flush=True)
