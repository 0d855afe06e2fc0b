"""The differentiable ops of the Horovod-compatible API: gradients flow
through them with horovod's backward rules.

* allreduce: the allreduce of the gradient (same op and factors);
* allgather: the Average allreduce of the gradient, narrowed to this
  rank's rows;
* broadcast: the Average allreduce of the gradient on the root, zeros
  elsewhere;
* alltoall: the alltoall of the gradient with the received splits;
* reducescatter: the allgather of the gradient (times size for Sum, times
  the factors).

Each runs in the process set given (`process_set=`), its backward too:
"this rank's rows" are those of its index in the set, "size" is the set's,
the root is a global rank.

The backward ops are unnamed (`<kind>.noname.<N>`, counted per set), so
every member must run the same backward passes, as with horovod.
"""

import torch

from . import mpi_ops as M
from ._common import Average, Sum, average_op, check_process_set
from .compression import Compression


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, scope):
        ctx.op, ctx.pre, ctx.post, ctx.scope = op, pre, post, scope
        return M.synchronize(M.allreduce_async(tensor, name=name, op=op, prescale_factor=pre,
                                               postscale_factor=post, process_set=scope))

    @staticmethod
    def backward(ctx, grad):
        return (allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post,
                          process_set=ctx.scope), None, None, None, None, None)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, scope, *tensors):
        ctx.op, ctx.pre, ctx.post, ctx.scope = op, pre, post, scope
        return tuple(M.synchronize(M.grouped_allreduce_async(
            list(tensors), name=name, op=op, prescale_factor=pre, postscale_factor=post,
            process_set=scope)))

    @staticmethod
    def backward(ctx, *grads):
        out = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.pre,
                                postscale_factor=ctx.post, process_set=ctx.scope)
        return (None, None, None, None, None) + tuple(out)


def _my_rows(dims, scope):
    """Where this rank's rows start in an allgather of `scope`."""
    return sum(dims[:scope.rank])


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, scope):
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.scope = scope
        return M.synchronize(M.allgather_async(tensor, name=name, process_set=scope))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.scope)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int32),
                         process_set=ctx.scope).tolist()
        return reduced.narrow(0, _my_rows(dims, ctx.scope), ctx.dim), None, None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, scope, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.scope = scope
        return tuple(M.synchronize(M.grouped_allgather_async(list(tensors), name=name,
                                                             process_set=scope)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ctx.scope)
        dims = grouped_allgather([torch.tensor([d], dtype=torch.int32) for d in ctx.dims],
                                 process_set=ctx.scope)
        out = [g.narrow(0, _my_rows(d.tolist(), ctx.scope), own)
               for g, d, own in zip(reduced, dims, ctx.dims)]
        return (None, None) + tuple(out)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, scope):
        ctx.root_rank, ctx.scope = root_rank, scope
        return M.synchronize(M.broadcast_async(tensor, root_rank, name=name, process_set=scope))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.scope)
        if ctx.scope.ranks[ctx.scope.rank] != ctx.root_rank:  # global ranks
            reduced = reduced * 0
        return reduced, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, scope):
        out, received = M.synchronize(M.alltoall_async(tensor, splits=splits, name=name,
                                                       process_set=scope))
        ctx.received, ctx.scope = received, scope
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _grad_received):
        out, _ = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.scope)
        return out, None, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, scope):
        ctx.op, ctx.pre, ctx.post, ctx.scope = op, pre, post, scope
        return M.synchronize(M.reducescatter_async(tensor, name=name, op=op,
                                                   prescale_factor=pre, postscale_factor=post,
                                                   process_set=scope))

    @staticmethod
    def backward(ctx, grad):
        return (allgather(_scale_back(grad, ctx), process_set=ctx.scope),
                None, None, None, None, None)


def _scale_back(grad, ctx):
    """A reducescatter's gradient before its allgather: times the set's
    size for Sum, times the factors."""
    if ctx.op == Sum:
        grad = grad * ctx.scope.size
    if ctx.pre != 1.0:
        grad = grad * ctx.pre
    if ctx.post != 1.0:
        grad = grad * ctx.post
    return grad


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, scope, *tensors):
        ctx.op, ctx.pre, ctx.post, ctx.scope = op, pre, post, scope
        return tuple(M.synchronize(M.grouped_reducescatter_async(
            list(tensors), name=name, op=op, prescale_factor=pre, postscale_factor=post,
            process_set=scope)))

    @staticmethod
    def backward(ctx, *grads):
        out = grouped_allgather([_scale_back(g, ctx) for g in grads], process_set=ctx.scope)
        return (None, None, None, None, None) + tuple(out)


# ---- the public, differentiable ops ----
# (`process_set`: the set the op and its backward run in, default every rank)

def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=M.global_process_set):
    """The reduction (default Average) of every member's tensor, as a new
    tensor. `compression` is applied around the op."""
    op = average_op(average, op)
    scope = check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, scope)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=M.global_process_set):
    """The allreduce of a list of tensors, fused by the library."""
    op = average_op(average, op)
    scope = check_process_set(process_set)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, scope,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def allgather(tensor, name=None, process_set=M.global_process_set):
    """Every member's tensor concatenated along the first dimension (which
    may differ between ranks; the others must not), in set order."""
    scope = check_process_set(process_set)
    return _Allgather.apply(tensor, name, scope)


def grouped_allgather(tensors, name=None, process_set=M.global_process_set):
    scope = check_process_set(process_set)
    return list(_GroupedAllgather.apply(name, scope, *tensors))


def broadcast(tensor, root_rank, name=None, process_set=M.global_process_set):
    """Root's tensor (`root_rank`: a global rank, a member of the set), as
    a new tensor (the input is left alone)."""
    scope = check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name, scope)


def alltoall(tensor, splits=None, name=None, process_set=M.global_process_set):
    """Sends `splits[r]` rows to the set's r-th rank (None: equal parts)
    and returns the rows received, in set order; with splits, also the
    number of rows received from each member (an int32 tensor)."""
    scope = check_process_set(process_set)
    out, received = _Alltoall.apply(tensor, splits, name, scope)
    return out if splits is None else (out, received)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=M.global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's part (along the first dimension, by its index in the
    set) of the reduction (Sum or Average) of every member's tensor."""
    scope = check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor, scope)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=M.global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    scope = check_process_set(process_set)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, scope,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
