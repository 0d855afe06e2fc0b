"""The ops of the Horovod-compatible API (`horovod.torch.mpi_ops`), over
the named asynchronous ops of the torch extension.

`*_async` ops return an int handle: `poll(handle)` tells whether it
completed, `synchronize(handle)` waits and returns the output, raising
HorovodInternalError (a RuntimeError) on every rank if the op failed: a
mismatch in type, shape, reduction, root or scale factors between the
ranks, a lost peer, a timeout. Argument errors raise ValueError where the
op is issued; so does the name of an op not synchronized yet (names are
per kind: `allreduce.<name>`; without a name, `allreduce.noname.<N>`). Only CPU tensors; process
sets and Adasum are not supported (NotImplementedError).

The differentiable ops (`allreduce`, `allgather`, `broadcast`, `alltoall`,
`reducescatter` and the grouped ones) are in _autograd.py.
"""

import atexit

import torch

import kungfu

from . import _C, _join
from ._common import (DTYPE_CODE, META_LEN, Average, Adasum, Handle,  # noqa: F401
                      HorovodInternalError, Max, Min, Product, Stage, Sum, average_op,
                      check_initialized, check_process_set, check_tensor, claim, finish_reduction,
                      full_name, kf_op, lock, meta_check, meta_issue, meta_row, prefix, release,
                      release_all,
                      scaled, state, then)

# ---- basics ----

_atexit = []


def init(comm=None, process_sets=None):
    """Starts the library (idempotent; again after `shutdown`). The ranks
    come from the launcher (kungfu-run, torchrun, srun, mpirun)."""
    if comm is not None:
        raise NotImplementedError("kungfu.torch: init(comm=...) is not supported: the launcher "
                                  "says who the ranks are")
    if process_sets:
        raise NotImplementedError("kungfu.torch: process sets are not supported")
    kungfu.init()
    state.initialized = True
    if not _atexit:
        _atexit.append(atexit.register(_at_exit))


def _at_exit():
    try:
        kungfu.finalize()
    except Exception:  # noqa: BLE001 (exiting anyway)
        pass


def shutdown():
    """Marks the API uninitialized. The library keeps running (it cannot
    start again once finalized; it is finalized at exit), so `init()`
    works again. Handles not synchronized are forgotten (their ops go on)."""
    state.initialized = False
    with lock:
        _handles.clear()
    release_all()


def is_initialized():
    return state.initialized


def rank():
    check_initialized()
    return kungfu.rank()


def size():
    check_initialized()
    return kungfu.size()


def local_rank():
    check_initialized()
    return kungfu.local_rank()


def local_size():
    check_initialized()
    return kungfu.local_size()


def cross_rank():
    """The index of this worker's host (hosts of equal size assumed)."""
    check_initialized()
    return kungfu.rank() // max(kungfu.local_size(), 1)


def cross_size():
    """The number of hosts (hosts of equal size assumed)."""
    check_initialized()
    return max(kungfu.size() // max(kungfu.local_size(), 1), 1)


def is_homogeneous():
    return True


def mpi_threads_supported():
    raise ValueError("kungfu.torch does not use MPI")


def mpi_enabled():
    return False


def mpi_built():
    return False


def gloo_enabled():
    return False


def gloo_built():
    return False


def nccl_built():
    return 0


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    return False


def rocm_built():
    return False


def start_timeline(file_path, mark_cycles=False):
    """Horovod's timeline is not supported; a no-op with a warning."""
    import warnings
    warnings.warn("kungfu.torch: the Horovod timeline is not supported; start_timeline is a "
                  "no-op", stacklevel=2)


def stop_timeline():
    pass


class ProcessSet:
    """Horovod's process sets are not supported: only the global one
    (`global_process_set`, every rank) exists."""

    def __init__(self, ranks_or_comm=None):
        self.ranks = sorted(ranks_or_comm) if ranks_or_comm is not None else None
        self.process_set_id = 0 if ranks_or_comm is None else None

    def size(self):
        return len(self.ranks) if self.ranks is not None else size()

    def rank(self):
        if self.ranks is None:
            return rank()
        return self.ranks.index(rank()) if rank() in self.ranks else -1

    def included(self):
        return self.ranks is None or rank() in self.ranks

    def __repr__(self):
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def add_process_set(process_set):
    raise NotImplementedError("kungfu.torch: process sets are not supported (every op spans "
                              "all ranks)")


def remove_process_set(process_set):
    raise NotImplementedError("kungfu.torch: process sets are not supported")


# ---- handles ----

_handles = {}
_next = [0]


def _register(handle):
    with lock:
        hid = _next[0]
        _next[0] += 1
        _handles[hid] = handle
    return hid


def poll(handle):
    """Whether the op of `handle` completed (True for unknown handles)."""
    h = _handles.get(handle)
    return True if h is None else h.done()


def synchronize(handle):
    """Waits for the op of `handle` and returns its output (None for an
    unknown handle); raises HorovodInternalError if the op failed."""
    with lock:
        h = _handles.pop(handle, None)
    if h is None:
        return None
    return h.wait()


def _issued(h, desc, announce=True):
    """Counts and (unless the caller announces it otherwise) announces an
    op that was issued, for hvd.join."""
    h.inst = _join.issued(desc[1])
    if announce:
        _join.announce((desc[0], desc[1], h.inst) + tuple(desc[2:]))
    return _register(h)


def _members(full, count):
    return [f"{full}_{i}of{count}" for i in range(count)]


# ---- allreduce ----

def _allreduce_start(tensors, outputs, name, op, pre, post, kind="allreduce",
                     grouped=False, check=True, announce=True):
    check_initialized()
    for t in tensors:
        check_tensor(t, kind)
    kops = [kf_op(op, t.dtype, kind) for t in tensors]
    n = kungfu.size()
    full = full_name(kind, name)
    members = _members(full, len(tensors)) if grouped else [full]
    h = Handle(f'{kind} "{full}"')
    claim([full] + (members if grouped else []), h)
    try:
        srcs = [scaled(t, pre) if pre != 1.0 else t for t in tensors]
        gathered = None
        if check:
            rows = []
            for t in tensors:
                rows += meta_row("allreduce", t, op, -1, pre, post)
            mw, gathered = meta_issue(full, rows)
            h.works.append(mw)
        if grouped:
            _C.group_start()
        try:
            for s, o, k, m in zip(srcs, outputs, kops, members):
                h.works.append(_C.allreduce(s, o, k, m))
        finally:
            if grouped:
                _C.group_end()
    except BaseException:
        release(h)
        raise

    def finish():
        if gathered is not None:
            meta_check(full, gathered, members=len(tensors))
        for o in outputs:
            finish_reduction(o, op, n, post)
        return list(outputs) if grouped else outputs[0]

    h.finish = finish
    desc = [(m, t.numel(), DTYPE_CODE[t.dtype], k) for m, t, k in zip(members, tensors, kops)]
    return _issued(h, ("allreduce", full, desc, len(tensors) if check else 0, grouped), announce)


def _new_like(tensor):
    return torch.empty(tensor.shape, dtype=tensor.dtype)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce into a new tensor; `synchronize` returns it."""
    op = average_op(average, op)
    check_process_set(process_set)
    check_tensor(tensor, "allreduce")
    return _allreduce_start([tensor], [_new_like(tensor)], name, op, prescale_factor,
                            postscale_factor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce in place."""
    op = average_op(average, op)
    check_process_set(process_set)
    return _allreduce_start([tensor], [tensor], name, op, prescale_factor, postscale_factor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Allreduces `tensor` in place and returns it."""
    op = average_op(average, op)
    return synchronize(allreduce_async_(tensor, None, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _grad_allreduce_async_(tensor, name, op, prescale_factor=1.0, postscale_factor=1.0):
    """DistributedOptimizer's: in place, without the metadata allgather
    (the library still checks counts, types and reductions), announced for
    hvd.join by the optimizer, once per step."""
    return _allreduce_start([tensor], [tensor], name, op, prescale_factor, postscale_factor,
                            check=False, announce=False)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts the allreduce of a list of tensors (fused by the library)
    into new tensors; `synchronize` returns their list."""
    op = average_op(average, op)
    check_process_set(process_set)
    tensors = list(tensors)
    for t in tensors:
        check_tensor(t, "grouped_allreduce")
    return _allreduce_start(tensors, [_new_like(t) for t in tensors], name, op,
                            prescale_factor, postscale_factor, "grouped_allreduce", True)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    op = average_op(average, op)
    check_process_set(process_set)
    tensors = list(tensors)
    return _allreduce_start(tensors, tensors, name, op, prescale_factor, postscale_factor,
                            "grouped_allreduce", True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    op = average_op(average, op)
    return synchronize(grouped_allreduce_async_(tensors, None, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """A sparse tensor's allreduce as allgathers of its indices and values;
    returns a function that waits and returns the (uncoalesced) result."""
    check_process_set(process_set)
    if op not in (Sum, Average):
        raise NotImplementedError(f"{prefix()}sparse allreduce: only Sum and Average")
    indices = allgather_async(tensor._indices().t().contiguous(), name=f"{name}.indices")
    values = allgather_async(tensor._values(), name=f"{name}.values")

    def handle():
        v = synchronize(values)
        i = synchronize(indices)
        if v.dim() == 0 or i.dim() == 0:
            return tensor.new().resize_as_(tensor)
        if op == Average:
            v = v / kungfu.size()
        return torch.sparse_coo_tensor(i.t(), v, tensor.size(), check_invariants=False)
    return handle


# ---- allgather ----

def _allgather_start(tensors, name, kind, grouped):
    check_initialized()
    for t in tensors:
        check_tensor(t, kind)
    full = full_name(kind, name)
    members = _members(full, len(tensors)) if grouped else [full]
    h = Handle(f'{kind} "{full}"')
    claim([full] + (members if grouped else []), h)
    try:
        h.works = [_C.allgather_v(t, m) for t, m in zip(tensors, members)]
    except BaseException:
        release(h)
        raise
    works = list(h.works)

    def finish():
        outs = [w.get_future().wait()[0] for w in works]  # the Future completes after wait()
        return outs if grouped else outs[0]
    h.finish = finish
    return _issued(h, ("allgather", full, members))


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts an allgather: every rank's tensor along the first dimension
    (which may differ between ranks), in rank order."""
    check_process_set(process_set)
    return _allgather_start([tensor], name, "allgather", False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    check_process_set(process_set)
    return _allgather_start(list(tensors), name, "grouped_allgather", True)


# ---- broadcast ----

def _broadcast_start(tensor, output, root_rank, name):
    check_initialized()
    check_tensor(tensor, "broadcast")
    n = kungfu.size()
    root = int(root_rank)
    if not 0 <= root < n:
        raise ValueError(f"{prefix()}broadcast: root rank {root_rank} is not one of the {n} ranks")
    full = full_name("broadcast", name)
    h = Handle(f'broadcast "{full}"')
    claim([full], h)
    try:
        mw, gathered = meta_issue(full, meta_row("broadcast", tensor, root=root))
    except BaseException:
        release(h)
        raise
    h.works.append(mw)
    h.stage = Stage()

    def second():  # once every rank's type, shape and root are known to agree
        meta_check(full, gathered)
        return _C.broadcast(tensor, output, root, full)
    then(mw, h.stage, second)
    h.finish = lambda: output
    return _issued(h, ("meta", full))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts a broadcast of root's tensor into a new tensor."""
    check_process_set(process_set)
    check_tensor(tensor, "broadcast")
    return _broadcast_start(tensor, _new_like(tensor), root_rank, name)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    check_process_set(process_set)
    return _broadcast_start(tensor, tensor, root_rank, name)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Broadcasts root's tensor into `tensor` and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall ----

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall: `splits[r]` rows (of the first dimension) go to
    rank r (None: equal parts). `synchronize` returns (output, the rows
    received from each rank as an int32 tensor)."""
    check_process_set(process_set)
    check_initialized()
    check_tensor(tensor, "alltoall")
    n, me = kungfu.size(), kungfu.rank()
    if tensor.dim() == 0:
        raise ValueError(f"{prefix()}alltoall: a scalar cannot be split")
    d0 = tensor.size(0)
    device = torch.device("cpu")
    if splits is None:
        if d0 % n:
            raise ValueError(f"{prefix()}alltoall: the first dimension ({d0}) does not split "
                             f"evenly over {n} ranks: give splits")
        send = [d0 // n] * n
    else:
        if isinstance(splits, (list, tuple)):
            splits = torch.tensor(splits, dtype=torch.int32)
        if not isinstance(splits, torch.Tensor) or splits.dtype != torch.int32:
            raise ValueError(f"{prefix()}alltoall: splits must be a list or an int32 tensor")
        if splits.dim() != 1 or splits.numel() != n:
            raise ValueError(f"{prefix()}alltoall: splits must hold one entry per rank ({n})")
        device = splits.device
        send = [int(x) for x in splits.tolist()]
        if any(x < 0 for x in send):
            raise ValueError(f"{prefix()}alltoall: negative splits")
        if sum(send) > d0:
            raise ValueError(f"{prefix()}alltoall: the splits add up to {sum(send)}, more than "
                             f"the first dimension ({d0})")
    full = full_name("alltoall", name)
    h = Handle(f'alltoall "{full}"')
    claim([full], h)
    try:
        mw, gathered = meta_issue(full, meta_row("alltoall", tensor) + send)
    except BaseException:
        release(h)
        raise
    h.works.append(mw)
    h.stage = Stage()
    box = {}

    def second():  # every rank's splits are known: allocate, send
        meta_check(full, gathered, extra=n)
        recv = gathered.view(n, META_LEN + n)[:, META_LEN + me].tolist()
        out = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
        src = tensor if sum(send) == d0 else tensor.narrow(0, 0, sum(send))
        box["out"], box["recv"] = out, recv
        return _C.alltoall(src, out, send, recv, full)
    then(mw, h.stage, second)
    h.finish = lambda: (box["out"], torch.tensor(box["recv"], dtype=torch.int32, device=device))
    return _issued(h, ("meta", full))


# ---- reducescatter ----

def _reducescatter_start(tensors, name, op, pre, post, kind, grouped):
    check_initialized()
    if op == Adasum:
        raise NotImplementedError(f"{prefix()}{kind}: Adasum is not supported by kungfu.torch")
    if op not in (Sum, Average):
        raise HorovodInternalError(f"{prefix()}{kind}: only Sum and Average are supported")
    for t in tensors:
        check_tensor(t, kind)
        if t.dim() == 0:
            raise ValueError(f"{prefix()}{kind}: a scalar cannot be scattered")
    kops = [kf_op(op, t.dtype, kind) for t in tensors]
    n, me = kungfu.size(), kungfu.rank()
    full = full_name(kind, name)
    members = _members(full, len(tensors)) if grouped else [full]
    h = Handle(f'{kind} "{full}"')
    claim([full] + (members if grouped else []), h)
    outs = []
    try:
        rows = []
        for t in tensors:
            rows += meta_row("reducescatter", t, op, -1, pre, post)
        mw, gathered = meta_issue(full, rows)
        h.works.append(mw)
        for t, k, m in zip(tensors, kops, members):
            d0, tail = t.size(0), tuple(t.shape[1:])
            # horovod's split: the first d0 % n ranks get one row more
            split = [d0 // n + (1 if r < d0 % n else 0) for r in range(n)]
            most = split[0]
            src = scaled(t, pre) if pre != 1.0 else t
            if d0 != most * n:
                padded = src.new_zeros((most * n,) + tail)
                at = 0
                for r in range(n):
                    padded[r * most:r * most + split[r]] = src[at:at + split[r]]
                    at += split[r]
                src = padded
            out = src.new_empty((most,) + tail)
            h.works.append(_C.reduce_scatter(src, out, k, m))
            outs.append((out, split[me]))
    except BaseException:
        release(h)
        raise

    def finish():
        meta_check(full, gathered, members=len(tensors))
        res = [finish_reduction(o if mine == o.size(0) else o[:mine].clone(), op, n, post)
               for o, mine in outs]
        return res if grouped else res[0]
    h.finish = finish
    return _issued(h, ("reducescatter", full, members))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter: the reduction of every rank's tensor, split
    along the first dimension (rank r gets d0 // size rows, one more if
    r < d0 % size)."""
    check_process_set(process_set)
    return _reducescatter_start([tensor], name, op, prescale_factor, postscale_factor,
                                "reducescatter", False)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    check_process_set(process_set)
    return _reducescatter_start(list(tensors), name, op, prescale_factor, postscale_factor,
                                "grouped_reducescatter", True)


# ---- join, barrier ----

def join(device=-1):
    """Blocks until every rank joined, taking part meanwhile in the ops the
    others issue (zeros for allreduces; allgather, broadcast, alltoall and
    reducescatter fail while a rank has joined). Returns the rank that
    joined last. `device` is accepted and ignored (CPU only)."""
    check_initialized()
    return _join.join()


def barrier(process_set=global_process_set):
    """Blocks until every rank called it (ops in flight go on)."""
    check_process_set(process_set)
    check_initialized()
    try:
        _C.barrier().wait()
    except RuntimeError as e:
        raise HorovodInternalError(str(e)) from e
