"""`init_process_group()`: the "kungfu" backend under any launcher.

`dist.init_process_group("kungfu")` reads torch's `env://` variables
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), which kungfu-run and
torchrun set and `mpirun`/`srun` do not. This takes rank and size from
the library instead (which knows every launcher) and gives torch a store
of this process: the kungfu backend does not use torch's store.
"""

from datetime import timedelta

import torch.distributed as dist

import kungfu


def init_process_group(timeout: timedelta = None, **kwargs) -> None:
    """Initialises torch.distributed's default group on the kungfu backend,
    whichever launcher started the job (kungfu-run, torchrun, srun,
    mpirun). Other keyword arguments go to `dist.init_process_group`."""
    kungfu.init()
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group("kungfu", store=dist.HashStore(), rank=kungfu.rank(),
                            world_size=kungfu.size(), **kwargs)
