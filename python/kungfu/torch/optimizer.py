"""`DistributedOptimizer`, as horovod.torch's: wraps a torch optimizer so
that gradients are allreduced as soon as autograd has produced them (a
post-accumulate-grad hook per parameter), overlapping the rest of the
backward pass, and `step()` waits for them first.

Gradients are fused: the parameters are cut into buckets of at most
KUNGFU_FUSION_BYTES bytes of gradients (else HOROVOD_FUSION_THRESHOLD;
default FUSION_BYTES; 0 turns fusion off) of one type, in the reverse of
their order in the parameter groups (about the order backward produces
them), once, when the optimizer is made: so every rank has the same
buckets without a negotiation. When the last gradient of a bucket is
produced, the bucket's gradients are copied into one flat tensor, which
is allreduced as one op named `allreduce.fused.<k>.<first parameter's
name>`; `synchronize` copies the results back. Horovod cuts its fusion
buffers by time instead (the gradients ready within a cycle), which needs
its coordinator to agree on them; DDP cuts fixed buckets, as here.

Without fusion (KUNGFU_FUSION_BYTES=0, or `groups=`), gradients are
allreduced one by one, named by their parameter's name (`named_parameters`,
default `allreduce.noname.<group>.<index>`), or by the given groups. A
parameter without a gradient on some rank is reduced with zeros there (in
`synchronize`).
"""

import os
import warnings
import weakref
from contextlib import contextmanager

import torch

from . import _join
from . import mpi_ops as M
from ._common import DTYPE_CODE, Adasum, Average, check_process_set, kf_op
from .compression import Compression


# The default of KUNGFU_FUSION_BYTES. Measured with
# benches/peers/torch_compare.py (docs/pytorch.md, "Speed").
FUSION_BYTES = 4 << 20


def fusion_bytes():
    """The fusion buffers' size: KUNGFU_FUSION_BYTES, else Horovod's
    HOROVOD_FUSION_THRESHOLD, else FUSION_BYTES."""
    for var in ("KUNGFU_FUSION_BYTES", "HOROVOD_FUSION_THRESHOLD"):
        v = os.environ.get(var)
        if v is not None and v.strip():
            try:
                n = int(v)
            except ValueError:
                raise ValueError(f"kungfu.torch: {var}={v!r} is not a number of bytes") from None
            if n < 0:
                raise ValueError(f"kungfu.torch: {var}={v!r} is negative")
            return n
    return FUSION_BYTES


class _Bucket:
    """Parameters whose gradients are allreduced as one flat tensor."""

    def __init__(self, index, params, name):
        self.index, self.params, self.name = index, params, name
        self.ready = 0  # gradients produced in this step so far
        self.fire = None  # starts the allreduce (set by the optimizer)

    def tick(self, _p):
        """A parameter's hook, when gradients are reduced at every backward
        pass (backward_passes_per_step 1): the bucket goes when its last
        gradient came. A second backward pass before step() raises, as
        horovod does."""
        self.ready += 1
        if self.ready == len(self.params):
            self.fire(self)
        elif self.ready > len(self.params):
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")


def _buckets(params, names, limit):
    """`params` (in backward order) cut into buckets of one type and at
    most `limit` bytes (a larger parameter is a bucket of its own)."""
    out, open_ = [], {}
    for p in params:
        size = p.numel() * p.element_size()
        cur = open_.get(p.dtype)
        if cur is None or (cur[1] + size > limit and cur[0]):
            cur = open_[p.dtype] = ([], 0)
            out.append(cur[0])
        cur[0].append(p)
        open_[p.dtype] = (cur[0], cur[1] + size)
    return [_Bucket(k, ps, f"fused.{k}.{names[ps[0]]}") for k, ps in enumerate(out)]


def _split_list(items, n):
    """`items` in n consecutive parts of nearly equal length."""
    d, r = divmod(len(items), n)
    out, at = [], 0
    for i in range(n):
        k = d + (1 if i < r else 0)
        out.append(items[at:at + k])
        at += k
    return [x for x in out if x]


class _DistributedOptimizer:
    """Put before the wrapped optimizer's class in a class made for it
    (`DistributedOptimizer`), so that `super()` is the wrapped optimizer."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=M.global_process_set):
        super().__init__(params)
        self.process_set = process_set
        self._global = process_set is None or process_set is M.global_process_set
        self._compression = compression
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        seen, dups = set(), set()
        for k, _ in named_parameters:
            (dups if k in seen else seen).add(k)
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found "
                             f"duplicates: {', '.join(sorted(dups))}")
        all_ids = {id(v) for group in self.param_groups for v in group["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             "were not named. Python object ids: "
                             f"{', '.join(str(i) for i in unnamed)}")

        self._parameter_names = {v: k for k, v in named_parameters}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._handles = {}
        self._hooks = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        if groups is not None:
            if not (isinstance(groups, list) or groups > 0):
                raise ValueError("groups should be a non-negative integer or a list of list of "
                                 "torch.Tensor.")
            if isinstance(groups, list):
                ids = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in ids:
                            raise ValueError("A parameter can only appear once in groups.")
                        ids.add(id(p))
        self._groups = groups
        self._p_to_group = {}
        self._group_counts = {}
        self._fusion = fusion_bytes() if groups is None else 0
        self._buckets = []
        self._p_to_bucket = {}
        # as horovod: a rank outside the process set reduces nothing
        if process_set.included() and (M.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._register_hooks()

    # ---- hooks ----

    def _register_hooks(self):
        if self._groups is not None:
            self._make_groups()
        elif self._fusion:
            ps = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
            self._buckets = _buckets(ps[::-1], self._parameter_names, self._fusion)
            self._p_to_bucket = {p: b for b in self._buckets for p in b.params}
        me = weakref.ref(self)
        # the hook: the bucket's own, cheap one where it can be (autograd
        # calls it for each of hundreds of parameters, on the backward
        # pass's critical path)
        fast = self._buckets and self.backward_passes_per_step == 1
        for b in self._buckets:
            b.fire = _fire(me)
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    hook = self._p_to_bucket[p].tick if fast else _hook(me)
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        if not self._global:  # hvd.join is the global set's: nothing to announce
            return
        # for hvd.join: a step is announced as one op, naming its allreduces
        # by their index here (the same on every rank)
        self._join_name, self._join_number = _join.register_optimizer(self)
        self._join_params = [p for group in self.param_groups for p in group["params"]
                             if p.requires_grad]
        self._join_index = {p: i for i, p in enumerate(self._join_params)}
        self._join_groups = list(self._group_counts)
        self._join_index.update({g: i for i, g in enumerate(self._join_groups)})
        self._join_index.update({b: b.index for b in self._buckets})

    def _make_groups(self):
        from .functions import broadcast_object
        ps = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        # the same order (so the same groups) on every rank: rank 0's
        root = 0 if self._global else self.process_set.ranks[0]
        order = broadcast_object([self._parameter_names.get(p) for p in ps], root_rank=root,
                                 process_set=self.process_set)
        ps.sort(key=lambda p: order.index(self._parameter_names.get(p)))
        if isinstance(self._groups, list):
            known = {id(p) for p in ps}
            groups = [[p for p in g if id(p) in known] for g in self._groups]
            grouped = {id(p) for g in groups for p in g}
            groups += [[p] for p in ps if id(p) not in grouped]
        else:
            groups = _split_list(ps, self._groups)
        for g in groups:
            g = tuple(g)
            if not g:
                continue
            for p in g:
                self._p_to_group[p] = g
            self._group_counts[g] = 0

    def _on_grad(self, p):
        if self._allreduce_delay[p] <= 0 and (p in self._p_to_bucket or (
                p in self._handles and self._handles[p][0] is not None)):
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._allreduce_delay[p] -= 1
        handle, ctx = None, None
        if self._allreduce_delay[p] == 0:
            bucket = self._p_to_bucket.get(p)
            if bucket is not None:
                bucket.ready += 1
                if bucket.ready == len(bucket.params):
                    self._handles[bucket] = self._bucket_allreduce_async(bucket)
                return
            if self._groups is not None:
                group = self._p_to_group[p]
                self._group_counts[group] += 1
                if self._group_counts[group] == len(group):
                    self._handles[group] = self._grouped_allreduce_grad_async(group)
                    for gp in group:
                        self._handles.pop(gp, None)
                    self._group_counts[group] = 0
                    return
            else:
                handle, ctx = self._allreduce_grad_async(p)
        self._handles[p] = (handle, ctx)

    def _factors(self):
        if self.op == Average:  # the division by size stays with Average
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p):
        if p.grad is None:  # another rank may have a gradient for it
            p.grad = p.data.new(p.size()).zero_()
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return M.sparse_allreduce_async(tensor, name=name, op=self.op,
                                                process_set=self.process_set), None
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        pre, post = self._factors()
        return M._grad_allreduce_async_(compressed, name, self.op, pre, post,
                                        self.process_set), ctx

    def _bucket_allreduce_async(self, bucket):
        """Starts the allreduce of `bucket`'s dense gradients as one flat
        tensor (missing gradients as zeros); returns (handle, (ctx,
        the parameters in it)). A sparse gradient goes on its own."""
        for p in bucket.params:
            if p.grad is not None and p.grad.is_sparse and p not in self._handles:
                self._handles[p] = self._allreduce_grad_async(p)
        dense = []
        for p in bucket.params:
            if p.grad is None:  # another rank may have a gradient for it
                p.grad = p.data.new(p.size()).zero_()
            if not p.grad.is_sparse:
                dense.append(p)
        if not dense:  # every gradient of it is sparse: each went on its own
            return None, (None, dense)
        flat = torch.cat([p.grad.reshape(-1) for p in dense])
        compressed, ctx = self._compression.compress(flat)
        pre, post = self._factors()
        handle = M._grad_allreduce_async_(compressed, bucket.name, self.op, pre, post,
                                          self.process_set)
        return handle, (ctx, dense)

    def _grouped_allreduce_grad_async(self, group):
        name = self._parameter_names.get(group[0])
        pairs = [self._compression.compress(p.grad) for p in group]
        pre, post = self._factors()
        handle = M._allreduce_start([c for c, _ in pairs], [c for c, _ in pairs], name, self.op,
                                    pre, post, "grouped_allreduce", True, check=False,
                                    announce=False, scope=self.process_set)
        return handle, [ctx for _, ctx in pairs]

    def _join_desc(self, code, index):
        """The allreduce that entry (code, index) of an announced step stands
        for, as hvd.join serves it (see _join._serve): code 0 a parameter,
        1 a group, 2 a bucket (its dense gradients: a sparse one is
        announced on its own)."""
        if code == 2:
            b = self._buckets[index]
            dense = [p for p in b.params if p.grad is None or not p.grad.is_sparse]
            dtype = self._compression.compress(torch.empty(0, dtype=dense[0].dtype))[0].dtype
            full = f"allreduce.{b.name}"
            member = (full, sum(p.numel() for p in dense), DTYPE_CODE[dtype],
                      kf_op(self.op, dtype, "allreduce"), 0)
            return ("allreduce", full, [member], False)
        ps = [self._join_params[index]] if code == 0 else list(self._join_groups[index])
        members = []
        for p in ps:
            dtype = self._compression.compress(torch.empty(0, dtype=p.dtype))[0].dtype
            members.append((p.numel(), DTYPE_CODE[dtype], kf_op(self.op, dtype, "allreduce"), 0))
        if code == 0:
            full = f"allreduce.{self._parameter_names[ps[0]]}"
            return ("allreduce", full, [(full,) + members[0]], False)
        full = f"grouped_allreduce.{self._parameter_names[ps[0]]}"
        names = M._members(full, len(ps))
        return ("allreduce", full, [(m,) + x for m, x in zip(names, members)], True)

    def _announce_step(self):
        if not hasattr(self, "_join_name") or not _join.enabled:
            return
        inst = _join.issued(self._join_name)
        entries = []
        for key, (handle, _) in self._handles.items():
            h = None if callable(handle) else M._handles.get(handle)
            if h is None:  # sparse: its allgathers were announced
                continue
            code = 2 if isinstance(key, _Bucket) else 1 if isinstance(key, tuple) else 0
            entries.append((code, self._join_index[key], None if h.inst == inst else h.inst))
        entries.sort(key=lambda e: (e[0], e[1]))
        _join.announce(("optimizer", self._join_name, inst, entries, self._join_number))

    # ---- the optimizer ----

    def synchronize(self):
        """Waits for every gradient's allreduce (starting those not started:
        parameters whose hook did not run get zeros) and puts the results
        in the gradients. Nothing, on a rank outside the process set."""
        if not self.process_set.included():
            self._synchronized = True
            return
        done = set()
        for key in self._handles:
            if isinstance(key, _Bucket):
                done.update(key.params)
            else:
                done.update(key) if isinstance(key, tuple) else done.add(key)
        for b in self._buckets:  # some gradients never came: zeros
            if b not in self._handles:
                self._handles[b] = self._bucket_allreduce_async(b)
                done.update(b.params)
        for p in self._requires_update - done:
            self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, _) in list(self._handles.items()):
            if handle is None and not isinstance(p, _Bucket):
                self._handles[p] = self._allreduce_grad_async(p)
        self._announce_step()
        try:
            for p, (handle, ctx) in self._handles.items():
                if isinstance(p, _Bucket):
                    p.ready = 0
                    if handle is not None:
                        flat = self._compression.decompress(M.synchronize(handle), ctx[0])
                        grads = [gp.grad for gp in ctx[1]]
                        parts = flat.split([g.numel() for g in grads])
                        torch._foreach_copy_(grads,
                                             [x.view_as(g) for x, g in zip(parts, grads)])
                    for gp in p.params:
                        self._allreduce_delay[gp] = self.backward_passes_per_step
                    continue
                if isinstance(p, tuple):
                    for gp, out, gctx in zip(p, M.synchronize(handle), ctx):
                        self._allreduce_delay[gp] = self.backward_passes_per_step
                        gp.grad.set_(self._compression.decompress(out, gctx))
                    if self._groups is not None:
                        self._group_counts[p] = 0
                    continue
                out = handle() if callable(handle) else M.synchronize(handle)
                self._allreduce_delay[p] = self.backward_passes_per_step
                if self._groups is not None:
                    self._group_counts[self._p_to_group[p]] = 0
                if p.grad.is_sparse:
                    agg = self._compression.decompress(out, ctx)
                    if not agg.is_sparse:
                        agg = agg.to_sparse()
                    p.grad.zero_().add_(agg)
                else:
                    p.grad.set_(self._compression.decompress(out, ctx))
        finally:
            self._handles.clear()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """`step()` inside does not synchronize (after an explicit
        `synchronize()`, e.g. to clip the gradients in between)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def _local_step(self, closure=None):
        """The wrapped optimizer's step, without any allreduce."""
        return super().step(closure)

    def zero_grad(self, set_to_none=True):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super().zero_grad(set_to_none)

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        for b in self._buckets:
            b.ready = 0
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        return super().load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes


def _fire(ref):
    def fire(bucket):
        opt = ref()
        if opt is not None:
            opt._handles[bucket] = opt._bucket_allreduce_async(bucket)
    return fire


def _hook(ref):
    def hook(p):
        opt = ref()
        if opt is not None:
            opt._on_grad(p)
    return hook


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=M.global_process_set):
    """Wraps `optimizer` (its parameter groups and hyperparameters; its
    state starts empty) so that `step()` applies the reduction (`op`,
    default Average) of every rank's gradients.

    `backward_passes_per_step`: gradients accumulate locally over that
    many backward passes before the reduction. `gradient_predivide_factor`:
    with Average, gradients are divided by it before the sum and by
    size / it after. `groups` (or the deprecated `num_groups`): an int
    (that many groups) or lists of parameters reduced together as one
    fused op. `sparse_as_dense`: sparse gradients are reduced as dense.
    `process_set`: the gradients are reduced among its ranks only; on a
    rank outside it, `step()` is the wrapped optimizer's alone (every rank
    makes the optimizer, as with horovod). Adasum is not supported."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum:
        raise NotImplementedError("kungfu.torch: Adasum is not supported")
    if process_set is None:
        process_set = M.global_process_set
    if process_set.included():
        check_process_set(process_set)  # added (not removed), or ValueError
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, groups, sparse_as_dense, process_set)
