"""The ops of the Horovod-compatible API (`horovod.torch.mpi_ops`), over
the named asynchronous ops of the torch extension.

`*_async` ops return an int handle: `poll(handle)` tells whether it
completed, `synchronize(handle)` waits and returns the output, raising
HorovodInternalError (a RuntimeError) on every rank if the op failed: a
mismatch in type, shape, reduction, root or scale factors between the
ranks, a lost peer, a timeout. Argument errors raise ValueError where the
op is issued; so does the name of an op not synchronized yet (names are
per kind: `allreduce.<name>`; without a name, `allreduce.noname.<N>`). Only CPU tensors;
Adasum is not supported (NotImplementedError).

Process sets: every rank adds a set (`add_process_set`, or
`init(process_sets=[...])`) in the same order, so that the ids agree; the
set's members make a library group for it (`_C.group_create`, a collective
of the members alone) and every op given `process_set=` runs in that group,
among the members only: allgather and alltoall in set order, Average
dividing by the set's size, roots given as global ranks. An op on a set
this rank is not in, or one not added, raises ValueError. `join` stays
global: ops of other sets are not announced to it.

The differentiable ops (`allreduce`, `allgather`, `broadcast`, `alltoall`,
`reducescatter` and the grouped ones) are in _autograd.py.
"""

import atexit
from collections import deque

import torch

import kungfu

from . import _C, _join
from ._common import (DTYPE_CODE, META_LEN, Average, Adasum, Handle,  # noqa: F401
                      HorovodInternalError, Max, Min, ProcessSet, Product, Stage, Sum,
                      average_op, check_initialized, check_process_set, check_tensor, claim,
                      describe_checked, finish_reduction, full_name, global_process_set, kf_op,
                      lock, meta_check,
                      meta_issue, meta_row, new_set_scope, op_check, prefix, process_sets,
                      release, release_all, scaled, state, then)

# ---- basics ----

_atexit = []


def init(comm=None, process_sets=None):
    """Starts the library (idempotent; again after `shutdown`). The ranks
    come from the launcher (kungfu-run, torchrun, srun, mpirun).
    `process_sets`: ProcessSets to add now (every rank passes the same
    sets in the same order; a duplicate raises ValueError and adds none),
    or "dynamic" (none now: `add_process_set` works anyway)."""
    if comm is not None:
        raise NotImplementedError("kungfu.torch: init(comm=...) is not supported: the launcher "
                                  "says who the ranks are")
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of ProcessSet or \"dynamic\", not "
                             f"{process_sets!r}")
        process_sets = None
    kungfu.init()
    state.initialized = True
    if not _atexit:
        _atexit.append(atexit.register(_at_exit))
    if process_sets:
        _init_process_sets(list(process_sets))


def _at_exit():
    try:
        kungfu.finalize()
    except Exception:  # noqa: BLE001 (exiting anyway)
        pass


def shutdown():
    """Marks the API uninitialized. The library keeps running (it cannot
    start again once finalized; it is finalized at exit), so `init()`
    works again. Handles not synchronized are forgotten (their ops go on).
    Every process set is removed (its library group ended here), and ids
    count from 1 again, as in horovod."""
    for pid in list(process_sets):
        _remove(pid)
    _ids.reset()
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


# ---- process sets ----

class _Ids:
    """Process set ids: 1, 2, ... in the order sets are added, the ids of
    removed sets first again (in the order they were freed), as horovod's
    ProcessSetTable. Every rank adds and removes the same sets in the same
    order, so the ids agree."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.next, self.free = 1, deque()

    def take(self):
        if self.free:
            return self.free.popleft()
        self.next += 1
        return self.next - 1

    def give_back(self, pid):
        self.free.append(pid)


_ids = _Ids()


def _check_new(ps, taken=()):
    """ValueError unless `ps` may be added: ranks of the cluster, none
    twice, not the ranks of the global set or of a set added (or of
    `taken`)."""
    n = kungfu.size()
    ranks = ps.ranks
    if not ranks:
        raise ValueError(f"{prefix()}a process set needs at least one rank: {ps}")
    if any(not 0 <= r < n for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"{prefix()}{ps}: its ranks must be distinct ranks, from 0 to "
                         f"{n - 1}")
    if (ranks == list(range(n)) or tuple(ranks) in taken
            or any(list(s.ranks) == ranks for s in process_sets.values())):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")


def _add(ps):
    """Gives `ps` the next id; its members make its library group (a
    collective of them alone, blocking until all have called it)."""
    group = None
    if kungfu.rank() in ps.ranks:
        try:
            group = _C.group_create(list(ps.ranks))
        except RuntimeError as e:
            raise HorovodInternalError(f"{prefix()}making the library group of {ps} failed: "
                                       f"{e}") from e
    pid = _ids.take()
    ps.process_set_id = pid
    process_sets[pid] = new_set_scope(ps, pid, group)
    return ps


def _remove(pid):
    scope = process_sets.pop(pid)
    scope.process_set._invalidate()
    if scope.group is not None:
        try:
            _C.group_destroy(scope.group)
        except RuntimeError:  # already ended by the library (a resize, a recovery)
            pass
    _ids.give_back(pid)


def _init_process_sets(sets):
    """init's `process_sets`: each one gets the id of an added set of the
    same ranks, or is added; checked first, so a duplicate adds none."""
    taken = set()
    for i, ps in enumerate(sets):
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets entry number {i} is not a ProcessSet: {ps!r}")
        try:
            if tuple(ps.ranks) in taken:
                raise ValueError(f"Attempted to add a duplicate process set: {ps}")
            if not any(list(s.ranks) == ps.ranks for s in process_sets.values()):
                _check_new(ps, taken)
        except ValueError as e:
            raise ValueError(f"Horovod could not be initialized because process_sets entry "
                             f"number {i} is a duplicate or invalid: {e}") from None
        taken.add(tuple(ps.ranks))
    for ps in sets:
        known = [pid for pid, s in process_sets.items() if list(s.ranks) == ps.ranks]
        if known:
            ps.process_set_id = known[0]
        else:
            _add(ps)


def add_process_set(process_set):
    """Adds a process set (a ProcessSet or a list of ranks) and returns it
    with its id; every rank calls it, with the same sets in the same
    order. Its members make its library group here (blocking until all of
    them have called it). A set of the ranks of the global set or of a set
    added raises ValueError."""
    check_initialized()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps is global_process_set:
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    _check_new(ps)
    return _add(ps)


def remove_process_set(process_set):
    """Removes an added process set (every rank calls it): its members end
    its library group (ops in flight finish), the ProcessSet loses its id
    (it may be added again). Returns False for the global set or a set not
    added, else True."""
    pid = getattr(process_set, "process_set_id", None)
    if not pid:
        return False
    process_set._invalidate()
    if pid not in process_sets:
        return False
    _remove(pid)
    return True


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


def _issued(h, desc, announce=True, scope=None):
    """Counts and (unless the caller announces it otherwise) announces an
    op of the global set that was issued, for hvd.join; an op of another
    set is only registered (join is global: its ranks need not know)."""
    if scope is not None and not scope.is_global:
        return _register(h)
    h.inst = _join.issued(desc[1])
    if announce:
        _join.announce((desc[0], desc[1], h.inst) + tuple(desc[2:]))
    return _register(h)


def _members(full, count):
    return [f"{full}_{i}of{count}" for i in range(count)]


# ---- allreduce ----

def _allreduce_start(tensors, outputs, name, op, pre, post, kind="allreduce",
                     grouped=False, check=True, announce=True, scope=None):
    """Starts the allreduce of `tensors` into `outputs` among the ranks of
    `scope` (a Scope or a ProcessSet; default every rank). With `check`,
    each op carries the check of its tensor's shape and the scale factors
    (op_check): ranks that differ fail it, rather than reducing tensors of
    one count and other shapes."""
    check_initialized()
    scope = check_process_set(scope)
    for t in tensors:
        check_tensor(t, kind)
    kops = [kf_op(op, t.dtype, kind) for t in tensors]
    full = full_name(kind, name, scope)
    members = _members(full, len(tensors)) if grouped else [full]
    h = Handle(f'{kind} "{full}"{scope.where()}')
    claim([full] + (members if grouped else []), h, scope)
    checks = [op_check("allreduce", t, op, -1, pre, post) if check else 0 for t in tensors]
    if check:
        h.checked = describe_checked("allreduce", tensors, op, -1, pre, post)
    try:
        srcs = [scaled(t, pre) if pre != 1.0 else t for t in tensors]
        if grouped:
            _C.group_start()
        try:
            for s, o, k, m, c in zip(srcs, outputs, kops, members, checks):
                h.works.append(_C.allreduce(s, o, k, m, group=scope.group, check=c))
        finally:
            if grouped:
                _C.group_end()
    except BaseException:
        release(h)
        raise

    def finish():
        for o in outputs:
            finish_reduction(o, op, scope.size, post)
        return list(outputs) if grouped else outputs[0]

    h.finish = finish
    desc = [(m, t.numel(), DTYPE_CODE[t.dtype], k, c)
            for m, t, k, c in zip(members, tensors, kops, checks)]
    return _issued(h, ("allreduce", full, desc, grouped), announce, scope)


def _new_like(tensor):
    return torch.empty(tensor.shape, dtype=tensor.dtype)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce into a new tensor; `synchronize` returns it."""
    op = average_op(average, op)
    scope = check_process_set(process_set)
    check_tensor(tensor, "allreduce")
    return _allreduce_start([tensor], [_new_like(tensor)], name, op, prescale_factor,
                            postscale_factor, scope=scope)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce in place."""
    op = average_op(average, op)
    scope = check_process_set(process_set)
    return _allreduce_start([tensor], [tensor], name, op, prescale_factor, postscale_factor,
                            scope=scope)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Allreduces `tensor` in place and returns it."""
    op = average_op(average, op)
    return synchronize(allreduce_async_(tensor, None, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _grad_allreduce_async_(tensor, name, op, prescale_factor=1.0, postscale_factor=1.0,
                           process_set=global_process_set):
    """DistributedOptimizer's: in place, with no check of shapes (the
    library still checks counts, types and reductions), announced for
    hvd.join by the optimizer, once per step (ops of the global set)."""
    return _allreduce_start([tensor], [tensor], name, op, prescale_factor, postscale_factor,
                            check=False, announce=False, scope=process_set)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts the allreduce of a list of tensors (fused by the library)
    into new tensors; `synchronize` returns their list."""
    op = average_op(average, op)
    scope = check_process_set(process_set)
    tensors = list(tensors)
    for t in tensors:
        check_tensor(t, "grouped_allreduce")
    return _allreduce_start(tensors, [_new_like(t) for t in tensors], name, op,
                            prescale_factor, postscale_factor, "grouped_allreduce", True,
                            scope=scope)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    op = average_op(average, op)
    scope = check_process_set(process_set)
    tensors = list(tensors)
    return _allreduce_start(tensors, tensors, name, op, prescale_factor, postscale_factor,
                            "grouped_allreduce", True, scope=scope)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    op = average_op(average, op)
    return synchronize(grouped_allreduce_async_(tensors, None, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """A sparse tensor's allreduce as allgathers of its indices and values;
    returns a function that waits and returns the (uncoalesced) result."""
    scope = check_process_set(process_set)
    if op not in (Sum, Average):
        raise NotImplementedError(f"{prefix()}sparse allreduce: only Sum and Average")
    indices = allgather_async(tensor._indices().t().contiguous(), name=f"{name}.indices",
                              process_set=scope)
    values = allgather_async(tensor._values(), name=f"{name}.values", process_set=scope)

    def handle():
        v = synchronize(values)
        i = synchronize(indices)
        if v.dim() == 0 or i.dim() == 0:
            return tensor.new().resize_as_(tensor)
        if op == Average:
            v = v / scope.size
        return torch.sparse_coo_tensor(i.t(), v, tensor.size(), check_invariants=False)
    return handle


# ---- allgather ----

def _allgather_start(tensors, name, kind, grouped, scope):
    check_initialized()
    for t in tensors:
        check_tensor(t, kind)
    full = full_name(kind, name, scope)
    members = _members(full, len(tensors)) if grouped else [full]
    h = Handle(f'{kind} "{full}"{scope.where()}')
    claim([full] + (members if grouped else []), h, scope)
    try:
        h.works = [_C.allgather_v(t, m, group=scope.group) for t, m in zip(tensors, members)]
    except BaseException:
        release(h)
        raise
    works = list(h.works)

    def finish():
        outs = [w.get_future().wait()[0] for w in works]  # the Future completes after wait()
        return outs if grouped else outs[0]
    h.finish = finish
    return _issued(h, ("allgather", full, members), scope=scope)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts an allgather: every member's tensor along the first
    dimension (which may differ between ranks), in set order (rank order
    for the global set)."""
    scope = check_process_set(process_set)
    return _allgather_start([tensor], name, "allgather", False, scope)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    scope = check_process_set(process_set)
    return _allgather_start(list(tensors), name, "grouped_allgather", True, scope)


# ---- broadcast ----

def _broadcast_start(tensor, output, root_rank, name, scope):
    check_initialized()
    check_tensor(tensor, "broadcast")
    root = int(root_rank)
    set_root = scope.set_rank(root, "broadcast")
    full = full_name("broadcast", name, scope)
    h = Handle(f'broadcast "{full}"{scope.where()}')
    h.checked = describe_checked("broadcast", [tensor], root=root)
    claim([full], h, scope)
    check = op_check("broadcast", tensor, root=root)
    try:
        h.works.append(_C.broadcast(tensor, output, set_root, full, group=scope.group,
                                    check=check))
    except BaseException:
        release(h)
        raise
    h.finish = lambda: output
    return _issued(h, ("broadcast", full, set_root, tensor.numel(), DTYPE_CODE[tensor.dtype],
                       check), scope=scope)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts a broadcast of root's tensor (`root_rank`: a global rank, a
    member of the set) into a new tensor."""
    scope = check_process_set(process_set)
    check_tensor(tensor, "broadcast")
    return _broadcast_start(tensor, _new_like(tensor), root_rank, name, scope)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    scope = check_process_set(process_set)
    return _broadcast_start(tensor, tensor, root_rank, name, scope)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Broadcasts root's tensor into `tensor` and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall ----

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall: `splits[r]` rows (of the first dimension) go to
    the set's r-th rank (None: equal parts). `synchronize` returns (output,
    the rows received from each member as an int32 tensor)."""
    scope = check_process_set(process_set)
    check_initialized()
    check_tensor(tensor, "alltoall")
    n, me = scope.size, scope.rank
    ranks = "ranks" if scope.is_global else "ranks of the process set"
    if tensor.dim() == 0:
        raise ValueError(f"{prefix()}alltoall: a scalar cannot be split")
    d0 = tensor.size(0)
    device = torch.device("cpu")
    if splits is None:
        if d0 % n:
            raise ValueError(f"{prefix()}alltoall: the first dimension ({d0}) does not split "
                             f"evenly over {n} {ranks}: give splits")
        send = [d0 // n] * n
    else:
        if isinstance(splits, (list, tuple)):
            splits = torch.tensor(splits, dtype=torch.int32)
        if not isinstance(splits, torch.Tensor) or splits.dtype != torch.int32:
            raise ValueError(f"{prefix()}alltoall: splits must be a list or an int32 tensor")
        if splits.dim() != 1 or splits.numel() != n:
            raise ValueError(f"{prefix()}alltoall: splits must hold one entry per rank ({n} "
                             f"{ranks})")
        device = splits.device
        send = [int(x) for x in splits.tolist()]
        if any(x < 0 for x in send):
            raise ValueError(f"{prefix()}alltoall: negative splits")
        if sum(send) > d0:
            raise ValueError(f"{prefix()}alltoall: the splits add up to {sum(send)}, more than "
                             f"the first dimension ({d0})")
    full = full_name("alltoall", name, scope)
    h = Handle(f'alltoall "{full}"{scope.where()}')
    claim([full], h, scope)
    try:
        mw, gathered = meta_issue(full, meta_row("alltoall", tensor) + send, scope)
    except BaseException:
        release(h)
        raise
    h.works.append(mw)
    h.stage = Stage()
    box = {}

    def second():  # every member's splits are known: allocate, send
        meta_check(full, gathered, extra=n, scope=scope)
        recv = gathered.view(n, META_LEN + n)[:, META_LEN + me].tolist()
        out = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
        src = tensor if sum(send) == d0 else tensor.narrow(0, 0, sum(send))
        box["out"], box["recv"] = out, recv
        return _C.alltoall(src, out, send, recv, full, group=scope.group)
    then(mw, h.stage, second)
    h.finish = lambda: (box["out"], torch.tensor(box["recv"], dtype=torch.int32, device=device))
    return _issued(h, ("meta", full), scope=scope)


# ---- reducescatter ----

def _reducescatter_start(tensors, name, op, pre, post, kind, grouped, scope):
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
    n, me = scope.size, scope.rank
    full = full_name(kind, name, scope)
    members = _members(full, len(tensors)) if grouped else [full]
    h = Handle(f'{kind} "{full}"{scope.where()}')
    h.checked = describe_checked("reducescatter", tensors, op, -1, pre, post)
    claim([full] + (members if grouped else []), h, scope)
    outs = []
    try:
        for t, k, m in zip(tensors, kops, members):
            d0, tail = t.size(0), tuple(t.shape[1:])
            # horovod's split: the first d0 % n members get one row more
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
            check = op_check("reducescatter", t, op, -1, pre, post)
            h.works.append(_C.reduce_scatter(src, out, k, m, group=scope.group, check=check))
            outs.append((out, split[me]))
    except BaseException:
        release(h)
        raise

    def finish():
        res = [finish_reduction(o if mine == o.size(0) else o[:mine].clone(), op, n, post)
               for o, mine in outs]
        return res if grouped else res[0]
    h.finish = finish
    return _issued(h, ("reducescatter", full, members), scope=scope)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter: the reduction of every member's tensor,
    split along the first dimension (the set's r-th rank gets d0 // size
    rows, one more if r < d0 % size; size: the set's)."""
    scope = check_process_set(process_set)
    return _reducescatter_start([tensor], name, op, prescale_factor, postscale_factor,
                                "reducescatter", False, scope)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    scope = check_process_set(process_set)
    return _reducescatter_start(list(tensors), name, op, prescale_factor, postscale_factor,
                                "grouped_reducescatter", True, scope)


# ---- join, barrier ----

def join(device=-1):
    """Blocks until every rank joined, taking part meanwhile in the ops the
    others issue on the global set (zeros for allreduces; allgather,
    broadcast, alltoall and reducescatter fail while a rank has joined).
    Returns the rank that joined last. `device` is accepted and ignored
    (CPU only)."""
    check_initialized()
    return _join.join()


def barrier(process_set=global_process_set):
    """Blocks until every member of the set called it (ops in flight go
    on)."""
    scope = check_process_set(process_set)
    try:
        _C.barrier(group=scope.group).wait()
    except RuntimeError as e:
        raise HorovodInternalError(str(e)) from e
