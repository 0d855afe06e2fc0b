"""Torch's objects that follow a change of the library's cluster (a
recovery, a resize, a reconfigure): the process groups of every rank on
the kungfu backend, torch's map of the default group's ranks, and a
`DistributedDataParallel` module's reducer."""

import torch.distributed as dist


def refresh_torch_groups() -> None:
    """Every torch group of every rank on the kungfu backend takes the
    library's rank and size now; torch's map of the default group's ranks
    (which `DeviceMesh.from_group` and `get_group_rank` read) follows.
    Groups over a subset of the ranks made before the change fail their
    next op (`[KF_ERR_MEMBERSHIP_CHANGED]`): make them again."""
    if not dist.is_available() or not dist.is_initialized():
        return
    from .. import _C

    _C.membership_changed()
    c10d = dist.distributed_c10d
    pg = c10d._get_default_group()
    if dist.get_backend(pg) == "kungfu":
        c10d._world.pg_group_ranks[pg] = {r: r for r in range(pg.size())}


def reset_ddp(model) -> None:
    """If `model` is a `DistributedDataParallel` module: a fresh reducer,
    as a DDP module made now would have (its first bucket layout, no state
    of a step that failed halfway, the new world size), with its comm hooks
    registered again. Every worker of a changed cluster calls it, so that
    survivors and joiners (whose DDP is new) bucket their gradients alike;
    it runs no collective."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not isinstance(model, DDP):
        return
    model.reducer._remove_autograd_hooks()
    params, sparse = model._build_params_for_reducer()
    names = model._build_debug_param_to_name_mapping(params)
    model._ddp_init_helper(params, sparse, names, model.static_graph)
    model._has_rebuilt_buckets = False
    for hook, state in model._comm_hooks:
        dist._register_comm_hook(model.reducer, state, hook)
