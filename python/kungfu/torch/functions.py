"""Model and optimizer state across ranks, as horovod.torch.functions:
`broadcast_parameters`, `broadcast_optimizer_state`, `broadcast_object`,
`allgather_object`. Each takes `process_set=` (horovod's
`broadcast_object` does; the others here too): it runs among the set's
members, roots given as global ranks."""

import collections
import io
import pickle

import torch

from . import mpi_ops as M

try:  # what horovod uses; it pickles more (lambdas, local classes)
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover (depends on the environment)
    _pickler = pickle


def broadcast_parameters(params, root_rank, process_set=M.global_process_set):
    """Overwrites the tensors of `params` (a dict such as
    `model.state_dict()`, or a list of tensors or of (name, tensor)) with
    root's, in place."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [M.broadcast_async_(p, root_rank, name, process_set) for name, p in params]
    for h in handles:
        M.synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank, model=None,
                              process_set=M.global_process_set):
    """Overwrites the optimizer's state and hyperparameters with root's.
    An optimizer without state yet gets it first from a step with zero
    gradients (which does not move the parameters of most optimizers, as
    in horovod)."""
    from .optimizer import _DistributedOptimizer
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())

    if len(state_dict["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in state_dict["state"]:
                    p.grad = p.data.new(p.size()).zero_()
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                            isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                        p.grad = p.grad.to_sparse()
        if isinstance(optimizer, _DistributedOptimizer):
            optimizer._local_step()  # the wrapped optimizer's step: no allreduce
        else:
            optimizer.step()
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return

    params = []
    scalars = {}
    callbacks = {}
    occurrences = collections.defaultdict(int)

    def state_callback(pid, name):
        def assign(v):
            state_dict["state"][pid][name] = v
        return assign

    def option_callback(index, key):
        def assign(v):
            optimizer.param_groups[index][key] = v
        return assign

    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key == "params":
                continue
            k = f"{key}.{index}"
            scalars[k] = value
            callbacks[k] = option_callback(index, key)
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue
            for name, p in state_dict["state"][pid].items():
                occurrences[name] += 1
                k = f"{name}.{occurrences[name]}"
                if torch.is_tensor(p):
                    params.append((k, p))
                else:
                    scalars[k] = p
                    callbacks[k] = state_callback(pid, name)

    broadcast_parameters(params, root_rank, process_set)
    scalars = broadcast_object(scalars, root_rank, process_set=process_set)
    for k, v in scalars.items():
        callbacks[k](v)


def _dumps(obj):
    b = io.BytesIO()
    _pickler.dump(obj, b)
    return torch.frombuffer(bytearray(b.getvalue()), dtype=torch.uint8)


def _loads(t):
    return _pickler.loads(t.numpy().tobytes())


def broadcast_object(obj, root_rank=0, name=None, process_set=M.global_process_set):
    """Root's `obj` (pickled), on every member of the set."""
    if name is None:
        name = type(obj).__name__
    if M.rank() == root_rank:
        t = _dumps(obj)
        sz = torch.tensor([t.numel()], dtype=torch.int32)
        M.broadcast_(sz, root_rank, name + ".sz", process_set)
    else:
        sz = torch.tensor([0], dtype=torch.int32)
        M.broadcast_(sz, root_rank, name + ".sz", process_set)
        t = torch.empty(int(sz.item()), dtype=torch.uint8)
    M.broadcast_(t, root_rank, name + ".t", process_set)
    return obj if M.rank() == root_rank else _loads(t)


def allgather_object(obj, name=None, process_set=M.global_process_set):
    """Every member's `obj` (pickled), in set order."""
    if name is None:
        name = type(obj).__name__
    t = _dumps(obj)
    sizes = M.synchronize(M.allgather_async(torch.tensor([t.numel()], dtype=torch.int32),
                                            name=name + ".sz", process_set=process_set)).tolist()
    gathered = M.synchronize(M.allgather_async(t, name=name + ".t", process_set=process_set))
    out, at = [], 0
    for s in sizes:
        out.append(_loads(gathered[at:at + s]))
        at += s
    return out


__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]
