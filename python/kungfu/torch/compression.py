"""Gradient compression for the Horovod-compatible API
(`hvd.Compression.none`, `hvd.Compression.fp16`), as horovod.torch has it:
`compress(tensor) -> (tensor, ctx)` before the allreduce and
`decompress(tensor, ctx) -> tensor` after it."""

import torch


class Compressor:
    """The interface: both are static methods."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (others as they are) and
    casts the result back to the original type."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class Compression:
    """`Compression.none` and `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
