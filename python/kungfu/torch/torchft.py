"""The kungfu backend as torchft's process group of replica groups.

    from kungfu.torch.torchft import ProcessGroupKungfu
    pg = ProcessGroupKungfu(timeout=timedelta(seconds=10))
    manager = torchft.Manager(pg=pg, ...)

torchft (the `torchft` package, installed separately) calls `configure`
with each new quorum: here one process group lives for the whole
process, and each quorum reconfigures it (torch's reconfigure contract,
`kf_reconfigure`): the members trade their handles through the quorum's
store, and the quorum id is the uuid. torchft's own gloo group makes a
new group for each quorum instead.

The library's worker of this process starts alone (`KUNGFU_ALONE=1`), as
torchrun's `RANK` and `WORLD_SIZE` describe the replica group, not the
group of replicas: import this before anything initializes the library.
Without `KUNGFU_JOB_SECRET` (the same on every replica group) the handles
are not authenticated. Limits: the quorum id is the uuid, so quorum ids
must not start over (a restarted lighthouse) while a worker lives; one
library world per process, so the collectives inside a replica group of
several workers (FSDP, HSDP) need another backend.
"""

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

import kungfu

try:
    from torchft.process_group import ProcessGroupWrapper, create_store_client
except ImportError as e:  # the package is optional
    raise ImportError("kungfu.torch.torchft needs the torchft package (pip install "
                      f"torchft): {e}") from e

from . import _C


class ProcessGroupKungfu(ProcessGroupWrapper):
    """torchft's `ProcessGroup` on the kungfu backend (see the module)."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        if kungfu.is_initialized() and os.environ.get("KUNGFU_ALONE") != "1":
            raise RuntimeError("kungfu: ProcessGroupKungfu needs the library to start alone: "
                               "make it before anything initializes the library, or set "
                               "KUNGFU_ALONE=1")
        os.environ["KUNGFU_ALONE"] = "1"
        # rank 0 of 1 until the first quorum, in the reconfigure regime
        backend = _C.create_backend(0, 1, [], True)
        pg = dist.ProcessGroup(dist.HashStore(), 0, 1)
        kind = dist.ProcessGroup.BackendType.CUSTOM
        pg._set_default_backend(kind)
        pg._register_backend(torch.device("cpu"), kind, backend)
        self._backend, self._pg = backend, pg
        self._error: Optional[Exception] = None

    def getBackendName(self) -> str:
        return "torchft-kungfu"

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: Optional[int] = None, group_rank: Optional[int] = None,
                  group_world_size: Optional[int] = None,
                  global_ranks: Optional[list] = None) -> None:
        """Makes the group the quorum's `world_size` replicas, this one at
        `rank`: the members trade handles through the quorum's store and
        reconfigure with the quorum id as the uuid."""
        self._error = None
        store = create_store_client(store_addr, timeout=self._timeout)
        store.set(f"kungfu/handle/{rank}", self._backend.get_reconfigure_handle())
        handles = [store.get(f"kungfu/handle/{r}").decode() for r in range(world_size)]
        opts = dist.distributed_c10d.ReconfigureOptions()
        opts.uuid = int(quorum_id) if quorum_id is not None else 0
        opts.handles = handles
        opts.timeout = self._timeout
        try:
            self._backend.reconfigure(opts).wait()
        except Exception as e:
            self._error = e
            raise
        if (self._pg.rank(), self._pg.size()) != (rank, world_size):
            raise RuntimeError(f"kungfu: the quorum made this rank {self._pg.rank()} of "
                               f"{self._pg.size()}, torchft asked for {rank} of {world_size}")

    def abort(self, errored: bool = True) -> None:
        """Fails the ops in flight (`kf_abort`); the next `configure`
        brings the group back."""
        self._backend.abort()

    def shutdown(self) -> None:
        pass

    def errored(self) -> Optional[Exception]:
        return self._error

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
