"""KungFu-rs for PyTorch.

`import kungfu.torch` registers the torch.distributed backend "kungfu"
(`dist.init_process_group("kungfu")`), a c10d::Backend written in C++ over
kungfu.h, and offers the API of `horovod.torch`.
"""

import torch.distributed as _dist

from . import _ext

_C = _ext.load()


def _create_backend(opts, _options=None):
    """c10d's extended creator: the group's rank, size and global ranks
    (torch calls it on the group's members only). With
    `enable_reconfigure=True` and no launcher that connected the workers,
    the group waits for `dist._reconfigure`; the workers then share a job
    secret through torch's store, unless `KUNGFU_JOB_SECRET` gives one."""
    ranks = list(opts.global_ranks_in_group or [])
    reconfigure = bool(getattr(opts, "enable_reconfigure", False))
    if reconfigure and not ranks:
        _share_secret(opts.store, opts.group_rank, opts.group_size)
    return _C.create_backend(opts.group_rank, opts.group_size, ranks, reconfigure)


def _share_secret(store, rank, size):
    """Every worker of a group that no launcher started takes the secret
    its rank 0 made, through the group's store: the links and the
    reconfigure handles of the job prove it, so a worker of another job
    (another store) is refused. The store is trusted as torch trusts it
    for the rendezvous."""
    import os
    import secrets

    from .. import _capi

    if os.environ.get("KUNGFU_JOB_SECRET"):
        return
    _C.init()
    if _capi.lib.kf_size() == size and _capi.lib.kf_rank() == rank:
        return  # a launcher placed the workers (and gave the secret it has)
    key = "kungfu/job_secret"
    if rank == 0:
        store.set(key, secrets.token_hex(32))
    _C.set_job_secret(store.get(key).decode())


if "kungfu" not in _dist.Backend.backend_list:
    _dist.Backend.register_backend("kungfu", _create_backend, extended_api=True,
                                   devices=["cpu"])

# The Horovod-compatible API: `import kungfu.torch as hvd` in place of
# `import horovod.torch as hvd` (CPU tensors; process sets as library groups
# of their members; no Adasum).
from .compression import Compression  # noqa: E402,F401
from .mpi_ops import (  # noqa: E402,F401
    Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet, Sum,
    add_process_set, allgather_async, allreduce_, allreduce_async, allreduce_async_,
    alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_, ccl_built,
    cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set,
    grouped_allgather_async, grouped_allreduce_, grouped_allreduce_async,
    grouped_allreduce_async_, grouped_reducescatter_async, init, is_homogeneous,
    is_initialized, join, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, poll, rank, reducescatter_async, remove_process_set, rocm_built, shutdown, size,
    sparse_allreduce_async, start_timeline, stop_timeline, synchronize,
)
from ._autograd import (  # noqa: E402,F401
    allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
    grouped_reducescatter, reducescatter,
)
from .functions import (  # noqa: E402,F401
    allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters,
)
from .optimizer import DistributedOptimizer  # noqa: E402,F401
# hvd.elastic: run, TorchState, ElasticSampler (kungfu.torch.elastic)
from . import elastic  # noqa: E402,F401
