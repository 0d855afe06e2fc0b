"""An FSDP2 model (`fully_shard`) in the elastic state: its parameters are
sharded over the workers, so a lost worker takes its shards with it, and a
model sharded for N workers cannot run on another number. The rollback
point is therefore the whole model and optimizer state, gathered at each
commit (a collective over the model's mesh, DCP's full state dicts); after
a change of the cluster the model is made again for the new one (the
state's `rebuild`) and the whole state is loaded into it, each worker
keeping its shards."""


def _dcp():
    """DCP's state-dict functions and the options of whole states
    (imported on first use: `import kungfu.torch` stays light)."""
    from torch.distributed.checkpoint import state_dict as sd

    return sd, sd.StateDictOptions(full_state_dict=True)


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
    sd, full = _dcp()
    msd = {k: v.detach().clone()
           for k, v in sd.get_model_state_dict(model, options=full).items()}
    osd = None
    if optimizer is not None:
        osd = sd.get_optimizer_state_dict(model, optimizer, options=full)
    return msd, osd


def load_full_state(model, optimizer, msd, osd) -> None:
    """Loads a whole state (`full_state`'s) into a sharded model and its
    optimizer: each worker keeps its shards (a collective over the model's
    mesh)."""
    sd, full = _dcp()
    sd.set_model_state_dict(model, msd, options=full)
    if optimizer is not None and osd is not None:
        sd.set_optimizer_state_dict(model, optimizer, osd, options=full)
