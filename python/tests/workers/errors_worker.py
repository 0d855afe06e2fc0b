"""Errors of the kungfu backend: what it refuses, and what happens when the
ranks disagree; after each, the group must still work, and the job must end
normally (no rank's interpreter killed).

    kungfu-run -np N python errors_worker.py OUTDIR [FAMILY...]

Families: refused (arguments every rank gets wrong: refused on the caller's
thread, before anything is sent), extras (types beyond the test's seven
that the backend takes: bool, int8, int16, complex64), mismatch (ranks that
disagree: every rank gets a RuntimeError naming it, through wait() and
through the Future too), one_sided (one rank's arguments are wrong: it
raises at once, the others time out; run it with a short
KUNGFU_OP_TIMEOUT_MS), blocking_callback (a Future callback that runs
blocking collectives: it hangs if the backend blocks its completion thread;
run it with a short job timeout).
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist

from common import Recorder, generator, setup, values

RANK, N, KG = None, None, None


def expect_error(rec, family, case, fn, *needles, types=(RuntimeError,)):
    """fn() must raise one of `types` whose message contains every needle;
    returns the message."""
    try:
        fn()
    except types as e:
        msg = str(e)
        missing = [x for x in needles if x not in msg]
        rec.add(family, case, not missing,
                f"missing {missing} in: {msg[:600]}" if missing else msg[:600])
        return msg
    except Exception as e:  # noqa: BLE001
        rec.add(family, case, False, f"raised {type(e).__name__}, not {types}: {e}")
        return None
    rec.add(family, case, False, "did not raise")
    return None


def still_works(rec, family, case):
    """An all_reduce and an all_gather on kg after `case`, against gloo."""
    x = values("exact", "float32", (1000,), generator("after", case, RANK))

    def both():
        t = x.clone()
        dist.all_reduce(t, group=KG)
        ref = x.clone()
        dist.all_reduce(ref)
        out = torch.zeros(N * 1000)
        dist.all_gather_into_tensor(out, x, group=KG)
        ref_out = torch.zeros(N * 1000)
        dist.all_gather_into_tensor(ref_out, x)
        return torch.equal(t, ref) and torch.equal(out, ref_out)

    rec.guard(family, f"after {case}: the group works", lambda: rec.add(
        family, f"after {case}: the group works", both()))


def refused(rec):
    F = "refused"
    me = f"kungfu: rank {RANK}:"
    be = KG._get_backend(torch.device("cpu"))
    meta = torch.ones(3, device="meta")
    meta_big = torch.ones(3 * N, device="meta")
    # dist.all_reduce(meta) never reaches a backend (torch's meta kernel
    # runs instead), so the backend is called directly, as c10d would
    calls = {
        "allreduce": lambda: be.allreduce([meta]).wait(),
        "broadcast": lambda: be.broadcast([meta]).wait(),
        "reduce": lambda: be.reduce([meta]).wait(),
        "_allgather_base": lambda: be._allgather_base(meta_big, meta).wait(),
        "_reduce_scatter_base": lambda: be._reduce_scatter_base(meta, meta_big).wait(),
        "alltoall_base": lambda: be.alltoall_base(meta_big, meta_big, [], []).wait(),
    }
    for name, fn in calls.items():
        expect_error(rec, F, f"a meta tensor: {name}", fn, me, "a tensor on meta is not supported",
                     "CPU tensors only")
    # a CPU input with a meta output
    expect_error(rec, F, "a meta output", lambda: be._allgather_base(meta_big, torch.ones(3)).wait(),
                 me, "meta")
    expect_error(rec, F, "a sparse tensor", lambda: dist.all_reduce(torch.ones(3).to_sparse(), group=KG),
                 me, "only dense tensors")
    expect_error(rec, F, "float8", lambda: dist.all_reduce(
        torch.ones(3).to(torch.float8_e5m2), op=dist.ReduceOp.MAX, group=KG), me, "not supported")
    expect_error(rec, F, "AVG of int32", lambda: dist.all_reduce(
        torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG, group=KG), me, "AVG")
    expect_error(rec, F, "SUM of bool", lambda: dist.all_reduce(
        torch.ones(3, dtype=torch.bool), group=KG), me, "bool")
    expect_error(rec, F, "BAND", lambda: dist.all_reduce(
        torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND, group=KG), me, "only SUM")
    expect_error(rec, F, "all_gather_into_tensor: an output too small", lambda: dist.all_gather_into_tensor(
        torch.zeros(3 * N - 1), torch.ones(3), group=KG), me, "output must hold")
    expect_error(rec, F, "reduce_scatter_tensor: an input too small", lambda: dist.reduce_scatter_tensor(
        torch.zeros(3), torch.ones(3 * N - 1), group=KG), me, "input must hold")
    expect_error(rec, F, "all_to_all_single: not a multiple of the size", lambda: dist.all_to_all_single(
        torch.zeros(N + 1), torch.zeros(N + 1), group=KG), me, "multiple of the cluster size")
    expect_error(rec, F, "all_to_all_single: splits that do not add up", lambda: dist.all_to_all_single(
        torch.zeros(N), torch.zeros(N), [1] * N, [2] * N, group=KG), me, "add up")
    expect_error(rec, F, "all_gather: a list of the wrong length", lambda: dist.all_gather(
        [torch.zeros(3)] * (N + 1), torch.ones(3), group=KG), "all_gather")
    # ops the backend does not have: c10d's own error
    expect_error(rec, F, "all_to_all: lists of the wrong length", lambda: dist.all_to_all(
        [torch.zeros(2) for _ in range(N + 1)], [torch.ones(2) for _ in range(N + 1)], group=KG),
        me, "all_to_all")
    still_works(rec, F, "the refused calls")


def extras(rec):
    """Against a reference made here from every rank's inputs (gloo has no
    int16, for one)."""
    F = "extras"

    def make(name, rank):
        g = generator(name, rank)
        if name.startswith("bool"):
            return torch.rand(100, generator=g) < 0.5
        if name.startswith("int8"):
            return torch.randint(-30, 31, (100,), generator=g).to(torch.int8)
        if name.startswith("int16"):
            return torch.randint(-5, 6, (100,), generator=g).to(torch.int16)
        return (torch.randint(-8, 9, (100,), generator=g) / 4).to(torch.complex64) * (1 + 2j)

    cases = [("bool MAX", dist.ReduceOp.MAX, lambda a, b: a | b),
             ("bool MIN", dist.ReduceOp.MIN, lambda a, b: a & b),
             ("int8 SUM", dist.ReduceOp.SUM, lambda a, b: a + b),
             ("int16 PRODUCT", dist.ReduceOp.PRODUCT, lambda a, b: a * b),
             ("complex64 SUM", dist.ReduceOp.SUM, lambda a, b: a + b)]
    for name, op, combine in cases:
        def run(name=name, op=op, combine=combine):
            t = make(name, RANK)
            dist.all_reduce(t, op=op, group=KG)
            want = make(name, 0)
            for j in range(1, N):
                want = combine(want, make(name, j))
            rec.compare(F, name, t, want)
        rec.guard(F, name, run)

    def bc():
        t = make("bool bc", RANK)
        dist.broadcast(t, src=N - 1, group=KG)
        rec.compare(F, "bool broadcast", t, make("bool bc", N - 1))
    rec.guard(F, "bool broadcast", bc)


def mismatch(rec):
    F = "mismatch"
    me = f"kungfu: rank {RANK}:"
    odd = RANK % 2 == 1
    cases = {
        "all_reduce: sizes": lambda: dist.all_reduce(torch.ones(3 + RANK), group=KG),
        "all_reduce: dtypes": lambda: dist.all_reduce(
            torch.ones(3, dtype=torch.float64 if odd else torch.float32), group=KG),
        "all_reduce: ops": lambda: dist.all_reduce(
            torch.ones(3), op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM, group=KG),
        # each rank's splits add up, but rank r sends 2 rows where 1 are expected
        "all_to_all_single: splits": lambda: dist.all_to_all_single(
            torch.zeros(N), torch.zeros(2 * N), [1] * N, [2] * N, group=KG),
    }
    for case, fn in cases.items():
        needles = [me, "KF_ERR_MISMATCH"] if "splits" not in case else [me, "splits disagree"]
        expect_error(rec, F, case, fn, *needles)
        still_works(rec, F, case)
    # Ops with a root, the last rank's size differing from the others': the
    # ranks that receive from it, or that it receives from, must raise, and
    # (rooted ops end with confirmations through the tree) so must the
    # others, which only send;
    # family "mismatch_senders": the ranks that only send (a broadcast root,
    # reduce and gather leaves) must fail too, not complete.
    last = RANK == N - 1
    rooted = {
        "broadcast: the last rank's size": (
            lambda: dist.broadcast(torch.ones(5 + last), src=0, group=KG), last),
        "reduce: the last rank's size": (
            lambda: dist.reduce(torch.ones(5 + last), dst=0, group=KG), RANK == 0),
        "gather: the last rank's size": (
            lambda: dist.gather(torch.ones(2 + last), [torch.zeros(2)] * N if RANK == 0 else None,
                                dst=0, group=KG), RANK == 0),
        "scatter: the last rank's size": (
            lambda: dist.scatter(torch.zeros(2 + last), [torch.ones(2)] * N if RANK == 0 else None,
                                 src=0, group=KG), RANK != 0),
    }
    for case, (fn, receives) in rooted.items():
        if receives:
            expect_error(rec, F, case, fn, me, "KF_ERR_MISMATCH")
        else:
            expect_error(rec, "mismatch_senders", case, fn, me, "KF_ERR_MISMATCH")
        dist.barrier()
        still_works(rec, F, case)
    # every rank names itself the root of a broadcast
    expect_error(rec, "mismatch_senders", "broadcast: every rank its own root", lambda: dist.broadcast(
        torch.full((4,), float(RANK)), src=RANK, group=KG), me, "KF_ERR_MISMATCH")
    dist.barrier()
    still_works(rec, F, "broadcast: roots")
    # ... and of a scatter
    expect_error(rec, "mismatch_senders", "scatter: every rank its own root", lambda: dist.scatter(
        torch.zeros(2), [torch.full((2,), float(RANK))] * N, src=RANK, group=KG), me,
        "KF_ERR_MISMATCH")
    dist.barrier()
    still_works(rec, F, "scatter: roots")
    # point to point: the receiver's length differs from the sender's:
    # both ends raise
    if RANK == 0:
        expect_error(rec, F, "send: the receiver's length", lambda: dist.send(
            torch.ones(3), 1, group=KG), me, "KF_ERR_MISMATCH", "sent 12 bytes")
    elif RANK == 1:
        expect_error(rec, F, "recv: the sender's length", lambda: dist.recv(
            torch.zeros(4), 0, group=KG), me, "KF_ERR_MISMATCH", "expected 16")
    dist.barrier()
    still_works(rec, F, "send/recv: lengths")

    # async: wait() raises; the Future carries the error to then()
    w = dist.all_reduce(torch.ones(3 + RANK), group=KG, async_op=True)
    expect_error(rec, F, "async: wait()", w.wait, me, "KF_ERR_MISMATCH")
    w = dist.all_reduce(torch.ones(3 + RANK), group=KG, async_op=True)
    seen = []

    def cb(f):
        try:
            f.value()
            seen.append(None)
        except Exception as e:  # noqa: BLE001
            seen.append(str(e))
        return 0
    fut = w.get_future().then(cb)
    fut.wait()
    rec.add(F, "async: then() sees the error", bool(seen and seen[0] and me in seen[0]), str(seen)[:400])
    w = dist.all_reduce(torch.ones(3 + RANK), group=KG, async_op=True)
    expect_error(rec, F, "async: get_future().wait()", w.get_future().wait, me, "KF_ERR_MISMATCH")
    # several outstanding, one of them bad: the others complete
    good = [torch.full((10,), float(RANK)) for _ in range(4)]
    ws = [dist.all_reduce(good[0], group=KG, async_op=True),
          dist.all_reduce(good[1], group=KG, async_op=True),
          dist.all_reduce(torch.ones(3 + RANK), group=KG, async_op=True),
          dist.all_reduce(good[2], group=KG, async_op=True)]
    for i in (0, 1, 3):
        ws[i].wait()
    expect_error(rec, F, "async: one bad among good", ws[2].wait, me, "KF_ERR_MISMATCH")
    want = torch.full((10,), float(sum(range(N))))
    rec.add(F, "async: the good ones around a bad one", all(torch.equal(good[i], want) for i in range(3)))
    still_works(rec, F, "async errors")


def one_sided(rec):
    F = "one_sided"
    me = f"kungfu: rank {RANK}:"
    # rank 0 alone gets its arguments wrong: it raises at once; the others
    # wait for it until KUNGFU_OP_TIMEOUT_MS, then raise naming rank 0. It
    # is the group's first op: the runtime must have started before it
    # (the backend starts it at the group's creation), or rank 0 never
    # connects and the runtime fails for good on every rank
    t0 = time.monotonic()
    if RANK == 0:
        expect_error(rec, F, "the bad rank raises at once", lambda: dist.all_gather_into_tensor(
            torch.zeros(3 * N + 1), torch.ones(3), group=KG), me, "output must hold")
    else:
        # each times out, or is told by one that did (KF_ERR_ABORTED)
        msg = expect_error(rec, F, "the others fail", lambda: dist.all_gather_into_tensor(
            torch.zeros(3 * N), torch.ones(3), group=KG), me) or ""
        rec.add(F, "the others time out or abort", "[KF_ERR_TIMEOUT]" in msg or "[KF_ERR_ABORTED]" in msg,
                msg[:400])
        rec.add(F, "the others' error names rank 0",
                "waiting for ranks [0]" in msg or "waiting for rank 0" in msg, msg[:400])
    waited = time.monotonic() - t0
    # let the ranks meet (on gloo) before kungfu goes on: rank 0's next op
    # would otherwise wait as long for the others
    dist.barrier()
    rec.add(F, "timing", True, f"{waited:.2f} s")
    still_works(rec, F, "a one-sided error")


def blocking_callback(rec):
    """A Future callback that runs blocking collectives on the same group
    (gloo allows it). The backend completes ops on one thread, which runs
    the callbacks: a wait() there must not block it."""
    F = "blocking_callback"
    t, u = torch.ones(3), torch.ones(3)

    def cb(f):
        dist.all_reduce(u, group=KG)                     # wait() with no timeout
        w = dist.all_reduce(u, group=KG, async_op=True)
        w.wait(timeout=datetime.timedelta(seconds=30))
        dist.barrier(group=KG)
        return u

    got = dist.all_reduce(t, group=KG, async_op=True).get_future().then(cb).wait()
    rec.compare(F, "blocking all_reduces in a then() callback", got, torch.full((3,), float(N * N)))
    rec.compare(F, "the op of the future", t, torch.full((3,), float(N)))

    # a callback whose blocking op fails: the error reaches the callback
    seen = []

    def bad(f):
        try:
            dist.all_reduce(torch.ones(3 + RANK), group=KG)
            seen.append("no error")
        except RuntimeError as e:
            seen.append(str(e))
        return 0
    dist.all_reduce(torch.ones(3), group=KG, async_op=True).get_future().then(bad).wait()
    rec.add(F, "a failing blocking op in a callback raises there",
            bool(seen) and "KF_ERR_MISMATCH" in seen[0], str(seen)[:300])
    still_works(rec, F, "blocking callbacks")


FAMILIES = {"refused": refused, "extras": extras, "mismatch": mismatch, "one_sided": one_sided,
            "blocking_callback": blocking_callback}


def main():
    global RANK, N, KG
    outdir, wanted = sys.argv[1], sys.argv[2:] or ["refused", "extras", "mismatch"]
    RANK, N, KG = setup()
    rec = Recorder(outdir, RANK, N)
    for name in wanted:
        FAMILIES[name](rec)
        dist.barrier()
    rec.write()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
