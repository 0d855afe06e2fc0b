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

The backward ops are unnamed (`<kind>.noname.<N>`), so every rank must run
the same backward passes, as with horovod.
"""

import torch

from . import mpi_ops as M
from ._common import Average, Sum, average_op, check_process_set
from .compression import Compression


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post):
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return M.synchronize(M.allreduce_async(tensor, name=name, op=op, prescale_factor=pre,
                                               postscale_factor=post))

    @staticmethod
    def backward(ctx, grad):
        return (allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post),
                None, None, None, None)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, *tensors):
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return tuple(M.synchronize(M.grouped_allreduce_async(
            list(tensors), name=name, op=op, prescale_factor=pre, postscale_factor=post)))

    @staticmethod
    def backward(ctx, *grads):
        out = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.pre,
                                postscale_factor=ctx.post)
        return (None, None, None, None) + tuple(out)


def _my_rows(dims):
    r = M.rank()
    return sum(dims[:r])


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        return M.synchronize(M.allgather_async(tensor, name=name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int32)).tolist()
        return reduced.narrow(0, _my_rows(dims), ctx.dim), None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(M.synchronize(M.grouped_allgather_async(list(tensors), name=name)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(list(grads), op=Average)
        dims = grouped_allgather([torch.tensor([d], dtype=torch.int32) for d in ctx.dims])
        out = [g.narrow(0, _my_rows(d.tolist()), own)
               for g, d, own in zip(reduced, dims, ctx.dims)]
        return (None,) + tuple(out)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return M.synchronize(M.broadcast_async(tensor, root_rank, name=name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average)
        if M.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        out, received = M.synchronize(M.alltoall_async(tensor, splits=splits, name=name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _grad_received):
        out, _ = alltoall(grad.contiguous(), splits=ctx.received)
        return out, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post):
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return M.synchronize(M.reducescatter_async(tensor, name=name, op=op,
                                                   prescale_factor=pre, postscale_factor=post))

    @staticmethod
    def backward(ctx, grad):
        return _scatter_grad(grad, ctx), None, None, None, None


def _scale_back(grad, ctx):
    if ctx.op == Sum:
        grad = grad * M.size()
    if ctx.pre != 1.0:
        grad = grad * ctx.pre
    if ctx.post != 1.0:
        grad = grad * ctx.post
    return grad


def _scatter_grad(grad, ctx):
    return allgather(_scale_back(grad, ctx))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, *tensors):
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return tuple(M.synchronize(M.grouped_reducescatter_async(
            list(tensors), name=name, op=op, prescale_factor=pre, postscale_factor=post)))

    @staticmethod
    def backward(ctx, *grads):
        out = grouped_allgather([_scale_back(g, ctx) for g in grads])
        return (None, None, None, None) + tuple(out)


# ---- the public, differentiable ops ----

def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=M.global_process_set):
    """The reduction (default Average) of every rank's tensor, as a new
    tensor. `compression` is applied around the op."""
    op = average_op(average, op)
    check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=M.global_process_set):
    """The allreduce of a list of tensors, fused by the library."""
    op = average_op(average, op)
    check_process_set(process_set)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def allgather(tensor, name=None, process_set=M.global_process_set):
    """Every rank's tensor concatenated along the first dimension (which
    may differ between ranks; the others must not)."""
    check_process_set(process_set)
    return _Allgather.apply(tensor, name)


def grouped_allgather(tensors, name=None, process_set=M.global_process_set):
    check_process_set(process_set)
    return list(_GroupedAllgather.apply(name, *tensors))


def broadcast(tensor, root_rank, name=None, process_set=M.global_process_set):
    """Root's tensor, as a new tensor (the input is left alone)."""
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


def alltoall(tensor, splits=None, name=None, process_set=M.global_process_set):
    """Sends `splits[r]` rows to rank r (None: equal parts) and returns
    the rows received, in rank order; with splits, also the number of rows
    received from each rank (an int32 tensor)."""
    check_process_set(process_set)
    out, received = _Alltoall.apply(tensor, splits, name)
    return out if splits is None else (out, received)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=M.global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's part (along the first dimension) of the reduction (Sum
    or Average) of every rank's tensor."""
    check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=M.global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    check_process_set(process_set)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
