"""`hvd.join()` over ops that the library matches by name.

A rank that joined must take part in the ops the others still issue
(contributing zeros to allreduces, spoiling the others so that they fail
on every rank), so it must learn what they are. Every op of the API is
therefore announced: its k-th announcement in a process is an allgather of
a fixed-size slot named `kungfu.hvd.seq.<k>`, holding a description of the
op (its kind, name, instance, and for allreduces the element counts,
types and reduction). Ranks that issue the same ops post the same
announcements, so these complete alongside the ops (fire and forget); a
description too long for one slot takes consecutive ones.

A DistributedOptimizer's gradient allreduces are not announced one by one
but once per step, in `synchronize()`, as one description naming them by
their index in the optimizer (every rank makes its optimizers in the same
order, so a joined rank can tell what they are from its own).

Every process reads the completed announcements and remembers the ops the
others issued that it has not (yet). In `join()` a rank serves those,
then posts placeholders (`kungfu.hvd.seq.<k>` saying "joined since k0")
one at a time, serving what each round reveals, until a round in which
every rank has joined: `join` returns the rank that joined last (the
highest among the last ones) on every rank, and the ranks' announcement
counters agree again.

A joined rank waits in one placeholder until the others issue their next
op: longer than KUNGFU_OP_TIMEOUT_MS (60 s) fails the join. With
KUNGFU_HOROVOD_JOIN=0 (on every rank) ops are not announced, which saves
one small collective per op, and `join` raises.
"""

import os
import pickle
import struct
import weakref
from collections import deque

import torch

import kungfu

from . import _C
from ._common import (DTYPES, KF_AVG, KF_MIN, KF_PROD, KF_SUM, Bounded,
                      HorovodInternalError, lock, prefix)

SLOT = 1024
_HEAD = 8
_PAYLOAD = SLOT - _HEAD
_CHUNK, _JOINED = 1, 2
_MAX_UNREAD = 1 << 14

enabled = os.environ.get("KUNGFU_HOROVOD_JOIN", "1") not in ("0", "false", "no", "off")


class _Book:
    seq = 0                        # announcements posted by this process
    issued = Bounded(1 << 18)      # full name -> instances issued (or served) here
    pending = Bounded(1 << 16)     # (name, instance) -> description: the others', not ours yet
    partial = {}                   # rank -> [chunks so far, chunks in all]
    posted = deque()               # (work, gathered) of announcements not read yet


book = _Book()
# DistributedOptimizers (with hooks) by number, in the order they were made
# (the same on every rank): a step is announced as one op
_optimizers = weakref.WeakValueDictionary()
_next_optimizer = [0]


def reset():
    """Forgets every announcement: after the cluster changed (a resize, a
    recovery), when every worker, a new one too, starts counting again."""
    global book
    with lock:
        book = _Book()
        book.issued, book.pending, book.partial, book.posted = (
            Bounded(1 << 18), Bounded(1 << 16), {}, deque())


def register_optimizer(opt):
    with lock:
        i = _next_optimizer[0]
        _next_optimizer[0] += 1
        _optimizers[i] = opt
    return f"kungfu.optimizer.{i}", i


def _slot(kind, a=0, b=0, payload=b""):
    s = bytearray(SLOT)
    s[0] = kind
    struct.pack_into("<HHH", s, 1, a, b, len(payload))
    s[_HEAD:_HEAD + len(payload)] = payload
    return torch.frombuffer(s, dtype=torch.uint8).clone()


def _post(slot):
    """Posts this process's next announcement; returns (work, gathered)."""
    book.seq += 1
    gathered = torch.empty(SLOT * kungfu.size(), dtype=torch.uint8)
    return _C.allgather(slot, gathered, f"kungfu.hvd.seq.{book.seq}"), gathered


def issued(name):
    """Counts an op issued here (before it is announced); returns its
    instance number."""
    with lock:
        inst = book.issued.get(name, 0) + 1
        book.issued[name] = inst
        book.pending.pop((name, inst), None)
        return inst


def announce(desc):
    """Announces an op of this process (a tuple, see `_serve`)."""
    if not enabled:
        return
    data = pickle.dumps(desc, protocol=pickle.HIGHEST_PROTOCOL)
    chunks = [data[i:i + _PAYLOAD] for i in range(0, len(data), _PAYLOAD)] or [b""]
    with lock:
        for i, c in enumerate(chunks):
            book.posted.append(_post(_slot(_CHUNK, i, len(chunks), c)))
        _read()
        while len(book.posted) > _MAX_UNREAD:  # the ranks' ops differ: stop tracking the oldest
            book.posted.popleft()


def _read():
    """Reads the completed announcements at the front, in order."""
    while book.posted:
        work, gathered = book.posted[0]
        if not work.is_completed():
            return
        book.posted.popleft()
        try:
            work.wait()
        except RuntimeError:
            continue  # a peer lost or a timeout: the op failures say so
        _parse(gathered)


def _parse(gathered):
    """Reads one round; returns {rank: joined since} for the ranks that
    joined, and records the others' descriptions."""
    # the size the round was posted for (the cluster may have changed)
    me, n = kungfu.rank(), gathered.numel() // SLOT
    joined = {}
    raw = gathered.numpy().tobytes()
    mine = raw[me * SLOT:(me + 1) * SLOT]
    for r in range(n):
        s = raw[r * SLOT:(r + 1) * SLOT]
        if s[0] == _JOINED:
            joined[r] = struct.unpack_from("<q", s, _HEAD)[0]
            continue
        if s[0] != _CHUNK or r == me:
            continue
        i, total, length = struct.unpack_from("<HHH", s, 1)
        if total == 1 and s == mine:
            continue  # the op this rank announced in this round
        part = s[_HEAD:_HEAD + length]
        if i == 0:
            book.partial[r] = [[part], total]
        elif r in book.partial and len(book.partial[r][0]) == i:
            book.partial[r][0].append(part)
        else:
            book.partial.pop(r, None)  # the start came before this process read any
            continue
        chunks, total = book.partial[r]
        if len(chunks) == total:
            del book.partial[r]
            desc = pickle.loads(b"".join(chunks))
            name, inst = desc[1], desc[2]
            if book.issued.get(name, 0) < inst and (name, inst) not in book.pending:
                book.pending[(name, inst)] = desc
    return joined


# ---- serving the others' ops ----

def _identity(numel, dtype, kop):
    """What a joined rank contributes: the reduction's neutral element."""
    if kop in (KF_SUM, KF_AVG):
        return torch.zeros(numel, dtype=dtype)
    if kop == KF_PROD:
        return torch.ones(numel, dtype=dtype)
    if dtype == torch.bool:
        return torch.full((numel,), kop == KF_MIN, dtype=dtype)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    big = float("inf") if dtype.is_floating_point else info.max
    small = float("-inf") if dtype.is_floating_point else info.min
    return torch.full((numel,), big if kop == KF_MIN else small, dtype=dtype)


def _spoil_allgather(name):
    # an int32 row where the others send int64: a mismatch on every rank
    t = torch.zeros(16, dtype=torch.int32)
    return _C.allgather(t, torch.empty(16 * kungfu.size(), dtype=torch.int32), name)


def _serve(desc):
    """Issues this joined rank's part of an op another rank announced;
    returns the Works. Descriptions:
    ("allreduce", name, inst, members [(name, numel, dtype code, kop, check)], grouped)
    ("allgather", name, inst, member names)      the others fail (AG while a rank joined)
    ("broadcast", name, inst, root, numel, dtype code, check)
                                                 the others fail (another check)
    ("meta", name, inst)                         alltoall: the others fail
    ("reducescatter", name, inst, member names)  the others fail (another count)
    ("optimizer", name, inst, entries, number)   a DistributedOptimizer's step: its
        allreduces, as entries (0: a parameter, 1: a group; its index; its
        instance if not `inst`), see DistributedOptimizer._join_desc
    """
    kind, name = desc[0], desc[1]
    n = kungfu.size()
    works = []
    if kind == "allreduce":
        members, grouped = desc[3], desc[4]
        if grouped:
            _C.group_start()
        try:
            for mname, numel, code, kop, check in members:
                t = _identity(numel, DTYPES[code], kop)
                works.append(_C.allreduce(t, t, kop, mname, check=check))
        finally:
            if grouped:
                _C.group_end()
    elif kind == "allgather":
        for mname in desc[3]:
            works.append(_spoil_allgather(mname + "/shape"))
    elif kind == "optimizer":
        opt = _optimizers.get(desc[4])
        if opt is None:
            return works
        for code, index, inst in desc[3]:
            op_desc = opt._join_desc(code, index)
            inst = desc[2] if inst is None else inst
            if book.issued.get(op_desc[1], 0) < inst:
                book.issued[op_desc[1]] = inst
                works.extend(_serve((op_desc[0], op_desc[1], inst) + tuple(op_desc[2:])))
    elif kind == "broadcast":
        root, numel, code, check = desc[3:7]
        t = torch.zeros(numel, dtype=DTYPES[code])
        # the same op but for the check: a mismatch on every rank
        works.append(_C.broadcast(t, t, root, name, check=check ^ 1))
    elif kind == "meta":
        works.append(_spoil_allgather("meta:" + name))
    elif kind == "reducescatter":
        for mname in desc[3]:
            t = torch.zeros(n, dtype=torch.uint8)
            works.append(_C.reduce_scatter(t, torch.empty(1, dtype=torch.uint8), KF_SUM, mname))
    return works


def _serve_pending(works):
    for key in list(book.pending):
        desc = book.pending.pop(key)
        name, inst = key
        if book.issued.get(name, 0) >= inst:
            continue
        book.issued[name] = inst
        works.extend(_serve(desc))


def join():
    """See the module's docstring; returns the last rank to join."""
    if not enabled:
        raise NotImplementedError(
            "kungfu.torch: hvd.join() needs op announcements, which KUNGFU_HOROVOD_JOIN=0 "
            "turned off")
    n = kungfu.size()
    works = []
    while True:  # the announcements posted before: in order, serving as they come
        with lock:
            if not book.posted:
                break
            work, gathered = book.posted.popleft()
        try:
            work.wait()
        except RuntimeError:
            continue
        with lock:
            _parse(gathered)
            _serve_pending(works)
    with lock:
        _serve_pending(works)
        since = book.seq + 1
    while True:
        with lock:
            work, gathered = _post(_slot(_JOINED, payload=struct.pack("<q", since)))
        try:
            work.wait()
        except RuntimeError as e:
            raise HorovodInternalError(
                f"{prefix()}join: waiting for the other ranks' next op failed (a joined "
                f"rank waits at most KUNGFU_OP_TIMEOUT_MS for it): {e}") from e
        with lock:
            joined = _parse(gathered)
            _serve_pending(works)
        if len(joined) == n:
            break
    with lock:
        book.partial.clear()
    for w in works:  # the spoiled ones fail, as they should
        try:
            w.wait()
        except RuntimeError:
            pass
    return max(range(n), key=lambda r: (joined[r], r))
