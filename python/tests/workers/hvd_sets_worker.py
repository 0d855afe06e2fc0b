"""Horovod's process sets in kungfu.torch, 4 processes:

    kungfu-run -np 4 python hvd_sets_worker.py OUTDIR

Sets {0,2} and {1,3}: every op within them (allreduce, grouped allreduce,
allgather, broadcast from a global root, alltoall, reducescatter, barrier,
broadcast_object, allgather_object, broadcast_parameters, the gradients of
allgather and broadcast), values checked exactly (small integers); unnamed
ops counted per set; the same name in flight in two sets and the global
one; a mismatch within a set naming global ranks; what is refused (an op
of a set this rank is not in, a set not added, a duplicate set, a root
outside the set); join after set ops; removal, ids given again, a set of
three, `init(process_sets=...)`. Writes OUTDIR/rank<R>.json (common.Recorder).
"""

import sys
import time

import torch

import kungfu.torch as hvd
from common import Recorder


def raises(rec, case, fn, exc, words):
    """Checks that fn() raises `exc` with every one of `words` in its message."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        rec.add("errors", case, all(w in msg for w in words), msg)
        return
    except Exception as e:  # noqa: BLE001  the wrong error fails the case
        rec.add("errors", case, False, f"raised {type(e).__name__}: {e}")
        return
    rec.add("errors", case, False, f"did not raise {exc.__name__}")


def set_ops(rec, me, mine, ranks):
    """The ops within this rank's set `mine` (global ranks `ranks`)."""
    k = ranks.index(me)
    n = len(ranks)

    # allreduce: Sum and Average, int and float; grouped
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3) + 10 * me
    want = sum(torch.arange(6, dtype=torch.int64).reshape(2, 3) + 10 * r for r in ranks)
    rec.compare("allreduce", "sum int64", hvd.allreduce(t, op=hvd.Sum, process_set=mine), want)
    f = t.to(torch.float32)
    rec.compare("allreduce", "average float32", hvd.allreduce(f, process_set=mine),
                want.to(torch.float32) / n)
    rec.compare("allreduce", "average int64 (truncated)", hvd.allreduce(t, process_set=mine),
                torch.div(want, n, rounding_mode="trunc"))
    x = f.clone()
    hvd.allreduce_(x, op=hvd.Sum, name="inplace", process_set=mine)
    rec.compare("allreduce", "in place", x, want.to(torch.float32))
    outs = hvd.grouped_allreduce([f, f * 2], op=hvd.Sum, process_set=mine)
    rec.compare("allreduce", "grouped 0", outs[0], want.to(torch.float32))
    rec.compare("allreduce", "grouped 1", outs[1], want.to(torch.float32) * 2)

    # allgather: rank r gives r + 1 rows of r, in set order
    g = hvd.allgather(torch.full((me + 1, 2), float(me)), process_set=mine)
    rec.compare("allgather", "set order", g,
                torch.cat([torch.full((r + 1, 2), float(r)) for r in ranks]))
    objs = hvd.allgather_object({"rank": me}, process_set=mine)
    rec.add("allgather", "allgather_object", objs == [{"rank": r} for r in ranks], str(objs))

    # broadcast from each member, named by its global rank
    for root in ranks:
        src = torch.full((3,), float(me))
        out = hvd.broadcast(src, root, process_set=mine)
        rec.compare("broadcast", f"root {root}", out, torch.full((3,), float(root)))
        rec.compare("broadcast", f"root {root}: input kept", src, torch.full((3,), float(me)))
        y = torch.full((2,), me, dtype=torch.int32)
        hvd.broadcast_(y, root, name=f"inplace.{root}", process_set=mine)
        rec.compare("broadcast", f"root {root} in place", y, torch.full((2,), root,
                                                                        dtype=torch.int32))
    root = ranks[-1]
    obj = hvd.broadcast_object({"from": me, "list": [1, 2]} if me == root else {},
                               root_rank=root, process_set=mine)
    rec.add("broadcast", "broadcast_object", obj == {"from": root, "list": [1, 2]}, str(obj))
    params = {"w": torch.full((2, 2), float(me)), "b": torch.full((3,), -float(me))}
    hvd.broadcast_parameters(params, root_rank=ranks[0], process_set=mine)
    rec.compare("broadcast", "broadcast_parameters w", params["w"],
                torch.full((2, 2), float(ranks[0])))
    rec.compare("broadcast", "broadcast_parameters b", params["b"],
                torch.full((3,), -float(ranks[0])))

    # alltoall: to the set's i-th rank, i + 1 + me rows of 100 * me + its global rank
    send = torch.cat([torch.full((i + 1 + me, 2), 100.0 * me + r) for i, r in enumerate(ranks)])
    out, got = hvd.alltoall(send, [i + 1 + me for i in range(n)], process_set=mine)
    rec.compare("alltoall", "data", out,
                torch.cat([torch.full((k + 1 + r, 2), 100.0 * r + me) for r in ranks]))
    rec.compare("alltoall", "received splits", got,
                torch.tensor([k + 1 + r for r in ranks], dtype=torch.int32))
    even = hvd.alltoall(torch.full((2 * n,), float(me)), process_set=mine)
    rec.compare("alltoall", "equal parts", even,
                torch.cat([torch.full((2,), float(r)) for r in ranks]))

    # reducescatter: 5 rows over 2 members: 3 to the first, 2 to the second
    rows = torch.arange(10, dtype=torch.float32).reshape(5, 2) + me
    total = sum(torch.arange(10, dtype=torch.float32).reshape(5, 2) + r for r in ranks)
    parts = [total[:3], total[3:]]
    rec.compare("reducescatter", "sum, uneven", hvd.reducescatter(rows, op=hvd.Sum,
                                                                  process_set=mine), parts[k])
    rec.compare("reducescatter", "average", hvd.reducescatter(rows, process_set=mine),
                parts[k] / n)

    # gradients: allgather's narrows to this rank's rows by its set rank;
    # broadcast's is zero off the root
    a = torch.full((me + 1, 2), 1.0, requires_grad=True)
    gathered = hvd.allgather(a, process_set=mine)
    gathered.backward(torch.cat([torch.full((r + 1, 2), float(r)) for r in ranks]))
    rec.compare("gradient", "allgather", a.grad, torch.full((me + 1, 2), float(me)))
    b = torch.ones(3, requires_grad=True)
    hvd.broadcast(b, ranks[1], process_set=mine).backward(torch.ones(3))
    rec.compare("gradient", "broadcast", b.grad, torch.full((3,), 1.0 if me == ranks[1] else 0.0))
    c = torch.ones(4, 2, requires_grad=True)
    hvd.reducescatter(c, op=hvd.Sum, process_set=mine).backward(torch.ones(2, 2))
    rec.compare("gradient", "reducescatter sum (times the set's size)", c.grad,
                torch.full((4, 2), float(n)))


def main():
    outdir = sys.argv[1]
    torch.set_num_threads(1)
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    assert size == 4, "run with 4 processes"
    rec = Recorder(outdir, me, size)

    rec.add("sets", "before adding", hvd.ProcessSet([2, 0]).ranks == [0, 2]
            and hvd.ProcessSet([0, 2]).size() is None and hvd.ProcessSet([0, 2]).rank() is None)
    even = hvd.add_process_set([2, 0])
    odd = hvd.add_process_set(hvd.ProcessSet([1, 3]))
    mine, other = (even, odd) if me % 2 == 0 else (odd, even)
    ranks = mine.ranks
    rec.add("sets", "ids", (even.process_set_id, odd.process_set_id) == (1, 2),
            f"{even}, {odd}")
    rec.add("sets", "size, rank, included",
            (mine.size(), mine.rank(), mine.included(), other.included()) ==
            (2, ranks.index(me), True, False), str(mine))
    rec.add("sets", "global set", hvd.global_process_set.ranks == [0, 1, 2, 3]
            and hvd.global_process_set.process_set_id == 0)

    rec.guard("ops", "within the sets", lambda: set_ops(rec, me, mine, ranks))

    # unnamed ops counted per set: the even set runs three, the odd one, then
    # an unnamed global allreduce matches on every rank
    def counters():
        for _ in range(3 if mine is even else 1):
            hvd.allreduce(torch.ones(2), process_set=mine)
        rec.compare("names", "unnamed global op after unnamed set ops",
                    hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), 4.0))
    rec.guard("names", "per set counters", counters)

    # the same name in flight in a set and in the global set
    def same_name():
        h1 = hvd.allreduce_async(torch.ones(2), name="x", op=hvd.Sum, process_set=mine)
        h2 = hvd.allreduce_async(torch.ones(2), name="x", op=hvd.Sum)
        rec.compare("names", "same name: set", hvd.synchronize(h1), torch.full((2,), 2.0))
        rec.compare("names", "same name: global", hvd.synchronize(h2), torch.full((2,), 4.0))
    rec.guard("names", "same name", same_name)

    # a mismatch within a set fails on its members, naming global ranks
    shape = (2, 3) if ranks.index(me) == 0 else (3, 2)
    raises(rec, "mismatch in a set", lambda: hvd.allreduce(torch.ones(shape), name="mm",
                                                           process_set=mine),
           hvd.HorovodInternalError, [f"rank {ranks[0]}", f"rank {ranks[1]}",
                                      f"this rank has float32 {list(shape)}",
                                      f"process set {mine.process_set_id}"])
    # as many elements, another shape: no metadata is gathered, the check
    # of each op (kf_set_check) tells them apart
    first = ranks.index(me) == 0
    raises(rec, "broadcast of another shape in a set",
           lambda: hvd.broadcast(torch.ones((2, 3) if first else (3, 2)), ranks[0], name="mb",
                                 process_set=mine),
           hvd.HorovodInternalError, ["KF_ERR_MISMATCH", "this rank has float32 ["])
    raises(rec, "reducescatter of another shape in a set",
           lambda: hvd.reducescatter(torch.ones((4, 3) if first else (2, 6)), name="mr",
                                     process_set=mine),
           hvd.HorovodInternalError, ["KF_ERR_MISMATCH", "this rank has float32 ["])
    raises(rec, "grouped allreduce, one member of another shape",
           lambda: hvd.grouped_allreduce([torch.ones(3), torch.ones((2, 2) if first else (4,))],
                                         name="mg", process_set=mine),
           hvd.HorovodInternalError, ["KF_ERR_MISMATCH", "float32 [3] op=Average; float32 ["])

    # refused
    raises(rec, "an op of a set this rank is not in",
           lambda: hvd.allreduce(torch.ones(2), process_set=other), ValueError,
           ["not in process set", str(other.ranks)])
    raises(rec, "a barrier of a set this rank is not in", lambda: hvd.barrier(other),
           ValueError, ["not in process set"])
    raises(rec, "a set not added", lambda: hvd.allgather(torch.ones(2),
                                                         process_set=hvd.ProcessSet([0, 1])),
           ValueError, ["has not been added"])
    raises(rec, "a duplicate set", lambda: hvd.add_process_set([0, 2]), ValueError,
           ["duplicate"])
    raises(rec, "the global set's ranks", lambda: hvd.add_process_set(range(4)), ValueError,
           ["duplicate"])
    raises(rec, "a rank out of the cluster", lambda: hvd.add_process_set([0, 7]), ValueError,
           ["ranks"])
    raises(rec, "a root outside the set", lambda: hvd.broadcast(torch.ones(2), other.ranks[0],
                                                                process_set=mine),
           ValueError, [f"root rank {other.ranks[0]} is not in process set"])
    raises(rec, "alltoall splits per rank of the set",
           lambda: hvd.alltoall(torch.ones(4), [1, 1, 1, 1], process_set=mine), ValueError,
           ["one entry per rank (2 ranks of the process set)"])

    # barrier: rank 0 comes late; the other even rank waits for it
    def barrier():
        if me == 0:
            time.sleep(1.0)
        t0 = time.monotonic()
        hvd.barrier(process_set=mine)
        waited = time.monotonic() - t0
        if me == 2:
            rec.add("barrier", "waits for the set's late rank", waited >= 0.8, f"{waited:.2f} s")
        hvd.barrier()
        rec.add("barrier", "set, then global", True)
    rec.guard("barrier", "barrier", barrier)

    # join after set ops: rank 0 runs one more global allreduce, the others
    # have joined (zeros)
    def join():
        if me == 0:
            out = hvd.allreduce(torch.full((3,), 5.0), op=hvd.Sum, name="after-sets")
            rec.compare("join", "allreduce while the others joined", out, torch.full((3,), 5.0))
        last = hvd.join()
        rec.add("join", "last to join", last == 0, str(last))
    rec.guard("join", "join", join)

    # removal, ids given again, a set of three
    def removal():
        rec.add("remove", "global set", hvd.remove_process_set(hvd.global_process_set) is False)
        rec.add("remove", "a set not added",
                hvd.remove_process_set(hvd.ProcessSet([0, 1])) is False)
        rec.add("remove", "even", hvd.remove_process_set(even) is True)
        rec.add("remove", "invalidated", even.process_set_id is None and even.size() is None)
        rec.add("remove", "even again", hvd.remove_process_set(even) is False)
        if me % 2 == 0:
            raises(rec, "an op of a removed set", lambda: hvd.allreduce(torch.ones(1),
                                                                        process_set=even),
                   ValueError, ["has not been added"])
        three = hvd.add_process_set([0, 1, 2])
        rec.add("remove", "a freed id is given again", three.process_set_id == 1, str(three))
        if me != 3:
            rec.compare("remove", "allreduce in a set of three",
                        hvd.allreduce(torch.full((2,), float(me)), op=hvd.Sum, process_set=three),
                        torch.full((2,), 3.0))
        rec.add("remove", "odd", hvd.remove_process_set(odd) is True)
        rec.add("remove", "three", hvd.remove_process_set(three) is True)
        later = hvd.add_process_set([3, 1])
        rec.add("remove", "ids in the order freed", later.process_set_id == 2, str(later))
        if me % 2 == 1:
            rec.compare("remove", "a set made again works",
                        hvd.allreduce(torch.full((1,), float(me)), op=hvd.Sum,
                                      process_set=later), torch.full((1,), 4.0))
        hvd.barrier()
    rec.guard("remove", "removal", removal)

    # shutdown removes every set; init(process_sets=...) adds them again
    def reinit():
        left = hvd.ProcessSet([0, 1])
        hvd.barrier()
        hvd.shutdown()
        raises(rec, "init with a duplicate set",
               lambda: hvd.init(process_sets=[hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 0])]),
               ValueError, ["duplicate"])
        right = hvd.ProcessSet([2, 3])
        hvd.init(process_sets=[left, right])
        rec.add("init", "ids", (left.process_set_id, right.process_set_id) == (1, 2),
                f"{left}, {right}")
        here = left if me < 2 else right
        rec.compare("init", "allreduce in a set of init",
                    hvd.allreduce(torch.full((1,), float(me)), op=hvd.Sum, process_set=here),
                    torch.full((1,), float(sum(here.ranks))))
        hvd.barrier()
    rec.guard("init", "init with process sets", reinit)

    rec.write()
    hvd.shutdown()


if __name__ == "__main__":
    main()
