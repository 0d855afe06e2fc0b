"""An FSDP2 model (`fully_shard`) in the elastic state: its parameters are
sharded over the workers, so a lost worker takes its shards with it, and a
model sharded for N workers cannot run on another number. The rollback
point is therefore the whole model and optimizer state, gathered at each
commit (a collective over the model's mesh, DCP's full state dicts); after
a change of the cluster the model is made again for the new one (the
state's `rebuild`) and the whole state is loaded into it, each worker
keeping its shards."""

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)

_FULL = StateDictOptions(full_state_dict=True)


def is_fsdp(model) -> bool:
    """Whether `model` is sharded by FSDP2 (`fully_shard`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def full_state(model, optimizer):
    """The whole model and optimizer state, on every worker (a collective
    over the model's mesh): plain tensors, detached copies."""
    msd = {k: v.detach().clone() for k, v in get_model_state_dict(model, options=_FULL).items()}
    osd = None
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=_FULL)
    return msd, osd


def load_full_state(model, optimizer, msd, osd) -> None:
    """Loads a whole state (`full_state`'s) into a sharded model and its
    optimizer: each worker keeps its shards (a collective over the model's
    mesh)."""
    set_model_state_dict(model, msd, options=_FULL)
    if optimizer is not None and osd is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=_FULL)
