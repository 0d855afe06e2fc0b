"""Every op of the kungfu backend against gloo, in one job.

    kungfu-run -np N python ops_worker.py OUTDIR [FAMILY...]

The default group is gloo (the reference); `kg` is a kungfu group over the
same ranks. Each case runs the op on kg and on gloo with the same inputs and
compares every value (bit-exact, except for the "random" float inputs, where
another summation order may change the last bits); the ops that only move
data (broadcast, gathers, all-to-all) are checked against the inputs too,
which each rank can make for every other rank (they are seeded by rank).
gloo has no AVG for most ops: its reference is SUM / size. Each rank writes
its records to OUTDIR/rank<R>.json (see common.py).

Families (all by default): all_reduce broadcast all_gather
all_gather_into_tensor reduce_scatter_tensor reduce_scatter
all_to_all_single all_to_all_single_uneven reduce gather scatter all_to_all send_recv coalesced barrier
non_contiguous async.
"""

import sys
import time

import torch
import torch.distributed as dist

from common import DTYPES, FLOATS, OPS, Recorder, float_tol, generator, setup, values

RANK, N, KG = None, None, None
SHAPES = [(), (1,), (7,), (1000,), (65539,), (3, 5)]


class KungfuRaised(Exception):
    pass


def kinds(op: str, dt: str) -> list:
    """The input kinds of a reduction of type `dt` (see common.values)."""
    isfloat = dt in FLOATS
    rnd = ["random"] if dt in ("float32", "float64") else []
    if op == "SUM":
        return ["exact", *rnd] + ([] if isfloat else ["wrap"])
    if op == "AVG":
        return ["exact", *rnd] if isfloat else []
    if op == "PRODUCT":
        return ["prod", *rnd] + ([] if isfloat else ["wrap"])
    return ["wide", "exact"]


def tol_of(kind, dt):
    return float_tol(dt, N) if kind == "random" else None


def ref_op(op):
    """The op gloo runs for `op`: AVG is SUM there (then divided by size)."""
    return OPS["SUM"] if op == "AVG" else OPS[op]


def finish_ref(op, t):
    return t / N if op == "AVG" else t


def both(rec, family, case, fn):
    """fn(group) on kungfu, then on gloo (always, so that the ranks stay in
    step with gloo even if kungfu raised on some): (kungfu's, gloo's)
    results, or None (recorded as a failure) if kungfu raised."""
    try:
        k = fn(KG)
        err = None
    except Exception as e:  # noqa: BLE001
        k, err = None, e
    g = fn(None)
    if err is not None:
        rec.add(family, case, False, f"kungfu raised {type(err).__name__}: {err}")
        return None
    return k, g


def inputs(tag, kind, dt, shape, rank=None):
    """The input of `rank` (default: this one) for case `tag`."""
    r = RANK if rank is None else rank
    return values(kind, dt, shape, generator(tag, kind, dt, tuple(shape), r))


# ---- reductions ----

def all_reduce(rec):
    for dt in DTYPES:
        for op in OPS:
            for kind in kinds(op, dt):
                for shape in [(0,), *SHAPES]:
                    case = f"{op} {dt} {kind} shape={shape}"
                    x = inputs("ar" + op, kind, dt, shape)

                    def f(group):
                        t = x.clone()
                        dist.all_reduce(t, op=OPS[op] if group is KG else ref_op(op), group=group)
                        return t

                    r = both(rec, "all_reduce", case, f)
                    if r:
                        rec.compare("all_reduce", case, r[0], finish_ref(op, r[1]),
                                    tol_of(kind, dt), dtype=dt, op=op)


def reduce_scatter_tensor(rec):
    for dt in DTYPES:
        for op in OPS:
            for kind in kinds(op, dt):
                for block in [(1,), (7,), (1000,), (16411,), (3, 5)]:
                    case = f"{op} {dt} {kind} block={block}"
                    full = (N * block[0], *block[1:])
                    x = inputs("rst" + op, kind, dt, full)

                    def f(group):
                        out = torch.full(block, 7, dtype=DTYPES[dt])
                        dist.reduce_scatter_tensor(out, x, op=OPS[op] if group is KG else ref_op(op),
                                                   group=group)
                        return out

                    r = both(rec, "reduce_scatter_tensor", case, f)
                    if r:
                        rec.compare("reduce_scatter_tensor", case, r[0], finish_ref(op, r[1]),
                                    tol_of(kind, dt), dtype=dt, op=op)


def reduce_scatter(rec):
    for dt in DTYPES:
        for op in OPS:
            for kind in kinds(op, dt):
                for block in [(1,), (7,), (1000,), (3, 5)]:
                    case = f"{op} {dt} {kind} block={block}"
                    xs = [inputs(f"rs{op}/{j}", kind, dt, block) for j in range(N)]

                    def f(group):
                        out = torch.full(block, 7, dtype=DTYPES[dt])
                        dist.reduce_scatter(out, [x.clone() for x in xs],
                                            op=OPS[op] if group is KG else ref_op(op), group=group)
                        return out

                    r = both(rec, "reduce_scatter", case, f)
                    if r:
                        rec.compare("reduce_scatter", case, r[0], finish_ref(op, r[1]),
                                    tol_of(kind, dt), dtype=dt, op=op)


def reduce(rec):
    for root in range(N):
        for dt in DTYPES:
            for op in OPS:
                for kind in kinds(op, dt):
                    shapes = SHAPES if root == 0 else [(7,), (1000,)]
                    for shape in shapes:
                        case = f"root={root} {op} {dt} {kind} shape={shape}"
                        x = inputs(f"red{root}{op}", kind, dt, shape)

                        def f(group):
                            t = x.clone()
                            dist.reduce(t, dst=root, op=OPS[op] if group is KG else ref_op(op),
                                        group=group)
                            return t

                        r = both(rec, "reduce", case, f)
                        if r and RANK == root:
                            rec.compare("reduce", case, r[0], finish_ref(op, r[1]),
                                        tol_of(kind, dt), dtype=dt, op=op)
                        elif r:
                            rec.add("reduce", case, True, "not the root", dtype=dt, op=op)


# ---- data movement ----

def broadcast(rec):
    for root in range(N):
        for dt in DTYPES:
            for shape in SHAPES:
                case = f"root={root} {dt} shape={shape}"
                x = inputs(f"bc{root}", "wide", dt, shape)

                def f(group):
                    t = x.clone()
                    dist.broadcast(t, src=root, group=group)
                    return t

                r = both(rec, "broadcast", case, f)
                if r:
                    want = inputs(f"bc{root}", "wide", dt, shape, rank=root)
                    ok = rec.compare("broadcast", case + " vs gloo", r[0], r[1], dtype=dt)
                    ok and rec.compare("broadcast", case, r[0], want, dtype=dt)


def all_gather(rec):
    for dt in DTYPES:
        for shape in [(), (1,), (7,), (1000,), (3, 5)]:
            case = f"{dt} shape={shape}"
            x = inputs("ag", "wide", dt, shape)

            def f(group):
                outs = [torch.full(shape, 7 if group is KG else 0, dtype=DTYPES[dt]) for _ in range(N)]
                dist.all_gather(outs, x, group=group)
                return torch.stack(outs)

            r = both(rec, "all_gather", case, f)
            if r:
                want = torch.stack([inputs("ag", "wide", dt, shape, rank=j) for j in range(N)])
                ok = rec.compare("all_gather", case + " vs gloo", r[0], r[1], dtype=dt)
                ok and rec.compare("all_gather", case, r[0], want, dtype=dt)


def all_gather_into_tensor(rec):
    for dt in DTYPES:
        for shape in [(1,), (7,), (1000,), (65539,), (3, 5)]:
            for layout in ["concat", "stack"]:
                case = f"{dt} shape={shape} output={layout}"
                x = inputs("agt", "wide", dt, shape)
                out_shape = (N * shape[0], *shape[1:]) if layout == "concat" else (N, *shape)

                def f(group):
                    if group is KG:
                        out = torch.full(out_shape, 7, dtype=DTYPES[dt])
                        dist.all_gather_into_tensor(out, x, group=group)
                        return out
                    # gloo takes the concatenated layout only
                    out = torch.zeros((N * shape[0], *shape[1:]), dtype=DTYPES[dt])
                    dist.all_gather_into_tensor(out, x, group=group)
                    return out.view(out_shape)

                r = both(rec, "all_gather_into_tensor", case, f)
                if r:
                    parts = [inputs("agt", "wide", dt, shape, rank=j) for j in range(N)]
                    want = torch.cat(parts) if layout == "concat" else torch.stack(parts)
                    ok = rec.compare("all_gather_into_tensor", case + " vs gloo", r[0], r[1], dtype=dt)
                    ok and rec.compare("all_gather_into_tensor", case, r[0], want, dtype=dt)


def gather(rec):
    for root in range(N):
        for dt in DTYPES:
            for shape in [(1,), (7,), (1000,), (3, 5)]:
                case = f"root={root} {dt} shape={shape}"
                x = inputs(f"gat{root}", "wide", dt, shape)

                def f(group):
                    outs = None
                    if RANK == root:
                        outs = [torch.full(shape, 7 if group is KG else 0, dtype=DTYPES[dt])
                                for _ in range(N)]
                    dist.gather(x, outs, dst=root, group=group)
                    return torch.stack(outs) if outs else None

                r = both(rec, "gather", case, f)
                if r and RANK == root:
                    want = torch.stack([inputs(f"gat{root}", "wide", dt, shape, rank=j)
                                        for j in range(N)])
                    ok = rec.compare("gather", case + " vs gloo", r[0], r[1], dtype=dt)
                    ok and rec.compare("gather", case, r[0], want, dtype=dt)
                elif r:
                    rec.add("gather", case, True, "not the root", dtype=dt)


def scatter(rec):
    for root in range(N):
        for dt in DTYPES:
            for shape in [(1,), (7,), (1000,), (3, 5)]:
                case = f"root={root} {dt} shape={shape}"
                # the root's blocks: block j is what rank j gets
                parts = [inputs(f"sct{root}.{j}", "wide", dt, shape, rank=root) for j in range(N)]

                def f(group):
                    out = torch.full(shape, 7 if group is KG else 0, dtype=DTYPES[dt])
                    dist.scatter(out, parts if RANK == root else None, src=root, group=group)
                    return out

                r = both(rec, "scatter", case, f)
                if r:
                    ok = rec.compare("scatter", case + " vs gloo", r[0], r[1], dtype=dt)
                    ok and rec.compare("scatter", case, r[0], parts[RANK], dtype=dt)


def coalesced(rec):
    """c10d's coalescing manager (FSDP's coalesced collectives): several
    all_reduce, all_gather_into_tensor and reduce_scatter_tensor calls in
    one Work on kungfu, against the same calls one by one on gloo."""
    F = "coalesced"
    sizes = [1, 7, 1000, 15]

    def check(case, dt, fn):
        try:
            k, err = fn(KG, True), None
        except Exception as e:  # noqa: BLE001
            k, err = None, e
        g = fn(None, False)
        if err is not None:
            rec.add(F, case, False, f"kungfu raised {type(err).__name__}: {err}", dtype=dt)
        else:
            rec.compare(F, case + " vs gloo", k, g, dtype=dt)

    def run(group, coalesce, calls):
        if not coalesce:
            for c in calls:
                c(group)
            return
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for c in calls:
                c(group)
        cm.wait()

    for dt in DTYPES:
        xs = [inputs(f"co{i}", "exact", dt, (s,)) for i, s in enumerate(sizes)]

        def reduced(group, coalesce):
            ts = [x.clone() for x in xs]
            run(group, coalesce, [lambda g, t=t: dist.all_reduce(t, group=g) for t in ts])
            return torch.cat(ts)

        def gathered(group, coalesce):
            outs = [torch.full((N * x.numel(),), 7, dtype=DTYPES[dt]) for x in xs]
            run(group, coalesce, [lambda g, o=o, x=x: dist.all_gather_into_tensor(o, x, group=g)
                                  for o, x in zip(outs, xs)])
            return torch.cat(outs)

        def scattered(group, coalesce):
            ins = [inputs(f"cors{i}", "exact", dt, (N * s,)) for i, s in enumerate(sizes)]
            outs = [torch.full((s,), 7, dtype=DTYPES[dt]) for s in sizes]
            run(group, coalesce, [lambda g, o=o, i=i: dist.reduce_scatter_tensor(o, i, group=g)
                                  for o, i in zip(outs, ins)])
            return torch.cat(outs)

        check(f"all_reduce {dt}", dt, reduced)
        check(f"all_gather_into_tensor {dt}", dt, gathered)
        check(f"reduce_scatter_tensor {dt}", dt, scattered)


def all_to_all_lists(rec):
    """The list form of all_to_all, sizes that differ by pair (rank s sends
    s + d + 1 rows to rank d), checked against the senders' inputs (gloo
    has no list form)."""
    F = "all_to_all"
    for dt in DTYPES:
        for cols in [1, 3]:
            case = f"{dt} rows of {cols}"
            ins = [inputs(f"a2a{RANK}>{d}", "wide", dt, (RANK + d + 1, cols)) for d in range(N)]
            outs = [torch.full((s + RANK + 1, cols), 7, dtype=DTYPES[dt]) for s in range(N)]
            try:
                dist.all_to_all(outs, ins, group=KG)
            except Exception as e:  # noqa: BLE001
                rec.add(F, case, False, f"kungfu raised {type(e).__name__}: {e}", dtype=dt)
                continue
            want = [inputs(f"a2a{s}>{RANK}", "wide", dt, (s + RANK + 1, cols), rank=s)
                    for s in range(N)]
            rec.compare(F, case, torch.cat([o.reshape(-1) for o in outs]),
                        torch.cat([w.reshape(-1) for w in want]), dtype=dt)


def send_recv(rec):
    """Point to point round the ring (N even): blocking send and recv,
    isend/irecv under two tags received in the other order,
    batch_isend_irecv, and a receive from any rank at rank 0."""
    F = "send_recv"
    nxt, prv = (RANK + 1) % N, (RANK - 1) % N
    for dt in DTYPES:
        for shape in [(1,), (7,), (1000,), (65539,)]:
            case = f"{dt} shape={shape}"
            x = inputs("p2p", "wide", dt, shape)
            y = inputs("p2p.b", "wide", dt, shape)
            want = inputs("p2p", "wide", dt, shape, rank=prv)
            want_b = inputs("p2p.b", "wide", dt, shape, rank=prv)

            def blocking(group):
                out = torch.full(shape, 7, dtype=DTYPES[dt])
                # even ranks send first, odd ones receive first
                if RANK % 2 == 0:
                    dist.send(x, nxt, group=group)
                    dist.recv(out, prv, group=group)
                else:
                    dist.recv(out, prv, group=group)
                    dist.send(x, nxt, group=group)
                return out

            r = both(rec, F, "blocking " + case, blocking)
            if r:
                ok = rec.compare(F, "blocking " + case + " vs gloo", r[0], r[1], dtype=dt)
                ok and rec.compare(F, "blocking " + case, r[0], want, dtype=dt)

            def tagged(group):
                a = torch.full(shape, 7, dtype=DTYPES[dt])
                b = torch.full(shape, 7, dtype=DTYPES[dt])
                ws = [dist.isend(x, nxt, group=group, tag=5), dist.isend(y, nxt, group=group, tag=6)]
                dist.irecv(b, prv, group=group, tag=6).wait()
                dist.irecv(a, prv, group=group, tag=5).wait()
                for w in ws:
                    w.wait()
                return torch.stack([a, b])

            r = both(rec, F, "tagged " + case, tagged)
            if r:
                ok = rec.compare(F, "tagged " + case + " vs gloo", r[0], r[1], dtype=dt)
                ok and rec.compare(F, "tagged " + case, r[0], torch.stack([want, want_b]), dtype=dt)

            def batched(group):
                out = torch.full(shape, 7, dtype=DTYPES[dt])
                ops = [dist.P2POp(dist.isend, x, nxt, group=group),
                       dist.P2POp(dist.irecv, out, prv, group=group)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                return out

            r = both(rec, F, "batch_isend_irecv " + case, batched)
            if r:
                ok = rec.compare(F, "batch_isend_irecv " + case + " vs gloo", r[0], r[1], dtype=dt)
                ok and rec.compare(F, "batch_isend_irecv " + case, r[0], want, dtype=dt)

            def any_source(group):
                if RANK != 0:
                    dist.send(x, 0, group=group)
                    return torch.zeros(0)
                got = {}
                for _ in range(N - 1):
                    out = torch.full(shape, 7, dtype=DTYPES[dt])
                    src = dist.recv(out, group=group)
                    got[src] = out
                return torch.stack([got[j] for j in sorted(got)]), sorted(got)

            r = both(rec, F, "from any rank " + case, any_source)
            if r and RANK == 0:
                senders = list(range(1, N))
                everyone = torch.stack([inputs("p2p", "wide", dt, shape, rank=j) for j in senders])
                rec.add(F, "from any rank: the senders " + case, r[0][1] == senders, f"{r[0][1]}")
                ok = rec.compare(F, "from any rank " + case + " vs gloo", r[0][0], r[1][0], dtype=dt)
                ok and rec.compare(F, "from any rank " + case, r[0][0], everyone, dtype=dt)
            elif r:
                rec.add(F, "from any rank " + case, True, "a sender", dtype=dt)


def all_to_all_single(rec):
    for dt in DTYPES:
        for rows, inner in [(1, ()), (7, ()), (1000, ()), (16411, ()), (2, (3,)), (5, (2, 3))]:
            shape = (N * rows, *inner)
            case = f"{dt} shape={shape}"
            x = inputs("a2a", "wide", dt, shape)

            def f(group):
                out = torch.full(shape, 7 if group is KG else 0, dtype=DTYPES[dt])
                dist.all_to_all_single(out, x, group=group)
                return out

            r = both(rec, "all_to_all_single", case, f)
            if r:
                want = torch.cat([inputs("a2a", "wide", dt, shape, rank=j)[RANK * rows:(RANK + 1) * rows]
                                  for j in range(N)])
                ok = rec.compare("all_to_all_single", case + " vs gloo", r[0], r[1], dtype=dt)
                ok and rec.compare("all_to_all_single", case, r[0], want, dtype=dt)


# rows that rank `src` sends to rank `dst`, by pattern
SPLITS = {
    "both": lambda src, dst: (2 * src + dst) % 4,       # zeros included
    "big": lambda src, dst: 1000 * ((src + dst) % 2) + src,
    "in-only": lambda src, dst: dst + 1,                # rank r receives r+1 from each
    "out-only": lambda src, dst: src + 1,               # rank r sends r+1 to each
    "zeros": lambda src, dst: 0,                         # nothing at all
    "one-pair": lambda src, dst: 5 if (src, dst) == (1, 0) else 0,
}


def all_to_all_single_uneven(rec):
    for dt in DTYPES:
        for pattern, split in SPLITS.items():
            for inner in [(), (3,)]:
                ins = [split(RANK, j) for j in range(N)]
                outs = [split(j, RANK) for j in range(N)]
                case = f"{dt} splits={pattern} inner={inner} in={ins} out={outs}"
                x = inputs("a2av" + pattern, "wide", dt, (sum(ins), *inner))
                in_arg = None if pattern == "out-only" else ins
                out_arg = None if pattern == "in-only" else outs

                def f(group):
                    out = torch.full((sum(outs), *inner), 7 if group is KG else 0, dtype=DTYPES[dt])
                    dist.all_to_all_single(out, x, output_split_sizes=out_arg,
                                           input_split_sizes=in_arg, group=group)
                    return out

                r = both(rec, "all_to_all_single_uneven", case, f)
                if r:
                    parts = []
                    for j in range(N):
                        their = [split(j, d) for d in range(N)]
                        xj = inputs("a2av" + pattern, "wide", dt, (sum(their), *inner), rank=j)
                        start = sum(their[:RANK])
                        parts.append(xj[start:start + their[RANK]])
                    want = torch.cat(parts)
                    ok = rec.compare("all_to_all_single_uneven", case + " vs gloo", r[0], r[1], dtype=dt)
                    ok and rec.compare("all_to_all_single_uneven", case, r[0], want, dtype=dt)


def barrier(rec):
    for group, name in [(KG, "kungfu"), (None, "gloo")]:
        dist.barrier()
        t0 = time.monotonic()
        if RANK == 0:
            time.sleep(0.5)
        dist.barrier(group=group)
        waited = time.monotonic() - t0
        # every rank left the barrier only after rank 0 came to it
        rec.add("barrier", f"{name}: waits for the last rank", waited >= 0.4,
                f"waited {waited:.3f} s")
    rec.guard("barrier", "kungfu: 20 in a row, then an all_reduce", lambda: (
        [dist.barrier(group=KG) for _ in range(20)],
        rec.compare("barrier", "kungfu: 20 in a row, then an all_reduce",
                    (lambda t: (dist.all_reduce(t, group=KG), t)[1])(torch.ones(3)),
                    torch.full((3,), float(N)))))


# ---- non-contiguous tensors, views, async ----

def strided(t: torch.Tensor, fill=99) -> tuple:
    """(view, base): a non-contiguous view (every other element of a base
    twice as large along dim 0) holding `t`'s values; the other elements
    of the base hold `fill`, and must stay so."""
    base = torch.full((2 * t.shape[0], *t.shape[1:]) if t.dim() else (2,), fill, dtype=t.dtype)
    view = base[::2] if t.dim() else base[0]
    view.copy_(t)
    return view, base


def untouched(base, fill=99):
    return bool((base[1::2] == fill).all())


def non_contiguous(rec):
    F = "non_contiguous"
    for dt in DTYPES:
        kind = "exact"
        x = inputs("nc", kind, dt, (1000,))
        x2 = inputs("nc2", kind, dt, (6, N * 5))  # .t(): (N*5, 6), not contiguous

        def check(case, got, ref, base=None):
            ok = rec.compare(F, f"{case} {dt}", got, ref, dtype=dt)
            if ok and base is not None:
                rec.add(F, f"{case} {dt}: the rest of the base is untouched", untouched(base), dtype=dt)

        def ref_ar(t):
            t = t.contiguous().clone()
            dist.all_reduce(t)
            return t

        # all_reduce in place on a strided view and on a transposed one
        v, base = strided(x)
        rec.guard(F, f"all_reduce strided {dt}", lambda: (
            dist.all_reduce(v, group=KG), check("all_reduce strided", v.clone(), ref_ar(x), base)))
        t = x2.clone().t()
        rec.guard(F, f"all_reduce transposed {dt}", lambda: (
            dist.all_reduce(t, group=KG), check("all_reduce transposed", t.clone(), ref_ar(x2.t()))))
        # broadcast into a view
        v, base = strided(x)
        rec.guard(F, f"broadcast {dt}", lambda: (
            dist.broadcast(v, src=N - 1, group=KG),
            check("broadcast", v.clone(), inputs("nc", kind, dt, (1000,), rank=N - 1), base)))
        # reduce into a view (checked at the root)
        v, base = strided(x)

        def red():
            dist.reduce(v, dst=0, group=KG)
            want = x.clone()
            dist.reduce(want, dst=0)
            if RANK == 0:
                check("reduce", v.clone(), want, base)
        rec.guard(F, f"reduce {dt}", red)
        # all_gather: a strided input, outputs that are views of one base
        xin = x2.t()

        def ag():
            outs_base = torch.full((N * 5, 12), 99, dtype=x.dtype)
            outs = [outs_base[j * 5:(j + 1) * 5, ::2] for j in range(N)]
            dist.all_gather(outs, xin[:5], group=KG)
            ref = [torch.zeros(5, 6, dtype=x.dtype) for _ in range(N)]
            dist.all_gather(ref, xin[:5].contiguous())
            check("all_gather", torch.stack(outs), torch.stack(ref))
            rec.add(F, f"all_gather {dt}: the rest of the base is untouched",
                    bool((outs_base[:, 1::2] == 99).all()), dtype=dt)
        rec.guard(F, f"all_gather {dt}", ag)
        # all_gather_into_tensor: strided input, strided output
        v, _ = strided(x)

        def agt():
            out, base = strided(torch.zeros(N * 1000, dtype=x.dtype))
            dist.all_gather_into_tensor(out, v, group=KG)
            ref = torch.zeros(N * 1000, dtype=x.dtype)
            dist.all_gather_into_tensor(ref, x)
            check("all_gather_into_tensor", out.clone(), ref, base)
            check("all_gather_into_tensor: its input unchanged", v.clone(), x)
        rec.guard(F, f"all_gather_into_tensor {dt}", agt)

        # reduce_scatter_tensor: transposed input, strided output
        def rst():
            out, base = strided(torch.zeros(5, 6, dtype=x.dtype))
            dist.reduce_scatter_tensor(out, x2.t(), group=KG)
            ref = torch.zeros(5, 6, dtype=x.dtype)
            dist.reduce_scatter_tensor(ref, x2.t().contiguous())
            check("reduce_scatter_tensor", out.clone(), ref, base)
        rec.guard(F, f"reduce_scatter_tensor {dt}", rst)

        # reduce_scatter: a list of strided inputs
        def rs():
            ins = [x2.t()[j * 5:(j + 1) * 5] for j in range(N)]
            out = torch.zeros(5, 6, dtype=x.dtype)
            dist.reduce_scatter(out, ins, group=KG)
            ref = torch.zeros(5, 6, dtype=x.dtype)
            dist.reduce_scatter(ref, [i.contiguous() for i in ins])
            check("reduce_scatter", out, ref)
        rec.guard(F, f"reduce_scatter {dt}", rs)

        # all_to_all_single, even and uneven: transposed input, strided output
        def a2a(uneven):
            name = "all_to_all_single" + (" uneven" if uneven else "")
            ins = [(RANK + j) % 3 + 1 for j in range(N)] if uneven else None
            outs = [(j + RANK) % 3 + 1 for j in range(N)] if uneven else None
            rows = sum(ins) if uneven else N * 5
            src = inputs("nca2a", kind, dt, (6, rows)).t()
            out, base = strided(torch.zeros(sum(outs) if uneven else N * 5, 6, dtype=x.dtype))
            dist.all_to_all_single(out, src, outs, ins, group=KG)
            ref = torch.zeros(out.shape, dtype=x.dtype)
            dist.all_to_all_single(ref, src.contiguous(), outs, ins)
            check(name, out.clone(), ref, base)
        rec.guard(F, f"all_to_all_single {dt}", lambda: a2a(False))
        rec.guard(F, f"all_to_all_single uneven {dt}", lambda: a2a(True))

        # gather: strided input, outputs that are views
        def gat():
            outs = base = None
            if RANK == 1 % N:
                base = torch.full((N, 2000), 99, dtype=x.dtype)
                outs = [base[j, ::2] for j in range(N)]
            dist.gather(strided(x)[0], outs, dst=1 % N, group=KG)
            ref = [torch.zeros(1000, dtype=x.dtype) for _ in range(N)] if outs else None
            dist.gather(x, ref, dst=1 % N)
            if outs:
                check("gather", torch.stack(outs), torch.stack(ref))
                rec.add(F, f"gather {dt}: the rest of the base is untouched",
                        bool((base[:, 1::2] == 99).all()), dtype=dt)
        rec.guard(F, f"gather {dt}", gat)


def async_ops(rec):
    F = "async"

    def ref_ar(t, op=dist.ReduceOp.SUM):
        t = t.clone()
        dist.all_reduce(t, op=op)
        return t

    # wait(), is_completed(), result()
    x = inputs("as1", "exact", "float32", (1000,))
    t = x.clone()
    w = dist.all_reduce(t, group=KG, async_op=True)
    rec.add(F, "wait() returns True", w.wait() is True)
    rec.add(F, "is_completed() after wait()", w.is_completed())
    rec.compare(F, "all_reduce after wait()", t, ref_ar(x))
    rec.compare(F, "result() is the tensor", w.result()[0], t)

    # get_future().then(...)
    t = x.clone()
    fut = dist.all_reduce(t, group=KG, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    rec.compare(F, "get_future().then(...)", fut.wait(), ref_ar(x) * 2)
    t = x.clone()
    fut = dist.all_reduce(t, group=KG, async_op=True).get_future()
    got = fut.wait()
    rec.add(F, "future's value is [the tensor]", isinstance(got, list) and len(got) == 1
            and got[0].data_ptr() == t.data_ptr())

    # many at once, of every op, waited for in reverse order
    works, checks = [], []
    for i, dt in enumerate(DTYPES):
        xi = inputs(f"as-many{i}", "exact", dt, (100 + i,))
        ti = xi.clone()
        works.append(dist.all_reduce(ti, group=KG, async_op=True))
        checks.append((f"all_reduce {dt}", lambda ti=ti, xi=xi: (ti, ref_ar(xi))))
    b = inputs("as-bc", "wide", "int64", (33,))
    works.append(dist.broadcast(b, src=N - 1, group=KG, async_op=True))
    checks.append(("broadcast", lambda: (b, inputs("as-bc", "wide", "int64", (33,), rank=N - 1))))
    ag_out = [torch.zeros(5) for _ in range(N)]
    works.append(dist.all_gather(ag_out, torch.full((5,), float(RANK)), group=KG, async_op=True))
    checks.append(("all_gather", lambda: (torch.stack(ag_out),
                                          torch.arange(N).float().repeat_interleave(5).view(N, 5))))
    agt_out = torch.zeros(N * 3)
    works.append(dist.all_gather_into_tensor(agt_out, torch.full((3,), float(RANK)), group=KG,
                                             async_op=True))
    checks.append(("all_gather_into_tensor",
                   lambda: (agt_out, torch.arange(N).float().repeat_interleave(3))))
    rs_in = inputs("as-rs", "exact", "float64", (N * 4,))
    rs_out = torch.zeros(4, dtype=torch.float64)
    works.append(dist.reduce_scatter_tensor(rs_out, rs_in, group=KG, async_op=True))
    checks.append(("reduce_scatter_tensor", lambda: (rs_out, ref_ar(rs_in)[RANK * 4:(RANK + 1) * 4])))
    a2a_in = torch.arange(N * 2).float() + 100 * RANK
    a2a_out = torch.zeros(N * 2)
    works.append(dist.all_to_all_single(a2a_out, a2a_in, group=KG, async_op=True))
    checks.append(("all_to_all_single", lambda: (a2a_out, torch.tensor(
        [100.0 * j + 2 * RANK + k for j in range(N) for k in range(2)]))))
    red = torch.full((4,), float(RANK + 1))
    works.append(dist.reduce(red, dst=0, group=KG, async_op=True))
    if RANK == 0:
        checks.append(("reduce", lambda: (red, torch.full((4,), N * (N + 1) / 2))))
    gat_out = [torch.zeros(2) for _ in range(N)] if RANK == 0 else None
    works.append(dist.gather(torch.full((2,), float(RANK)), gat_out, dst=0, group=KG, async_op=True))
    if RANK == 0:
        checks.append(("gather", lambda: (torch.stack(gat_out),
                                          torch.arange(N).float().repeat_interleave(2).view(N, 2))))
    works.append(dist.barrier(group=KG, async_op=True))
    for w in reversed(works):
        w.wait()
    for name, get in checks:
        got, want = get()
        rec.compare(F, f"{len(works)} at once: {name}", got, want)

    # torch.futures.collect_all over async all_reduces
    ts = [inputs(f"as-col{i}", "exact", "float32", (10,)) for i in range(8)]
    refs = [ref_ar(t) for t in ts]
    futs = [dist.all_reduce(t, group=KG, async_op=True).get_future() for t in ts]
    torch.futures.collect_all(futs).wait()
    rec.add(F, "collect_all of 8", all(torch.equal(t, r) for t, r in zip(ts, refs)))

    # a callback that issues the next op (DDP's comm hooks do)
    t = x.clone()

    def chain(f):
        u = f.value()[0]
        return dist.all_reduce(u, group=KG, async_op=True).get_future()
    fut = dist.all_reduce(t, group=KG, async_op=True).get_future().then(chain)
    fut.wait().wait()
    rec.compare(F, "then() that issues the next all_reduce", t, ref_ar(ref_ar(x)))

    # the future of a list-output op (all_gather) holds the outputs
    outs = [torch.zeros(3) for _ in range(N)]
    got = dist.all_gather(outs, torch.full((3,), float(RANK)), group=KG, async_op=True).get_future().wait()
    rec.add(F, "all_gather's future value holds the outputs",
            isinstance(got, list) and len(got) == N and all(torch.equal(a, b) for a, b in zip(got, outs)),
            f"{got}")


FAMILIES = {
    "all_reduce": all_reduce,
    "broadcast": broadcast,
    "all_gather": all_gather,
    "all_gather_into_tensor": all_gather_into_tensor,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "reduce_scatter": reduce_scatter,
    "all_to_all_single": all_to_all_single,
    "all_to_all_single_uneven": all_to_all_single_uneven,
    "reduce": reduce,
    "gather": gather,
    "scatter": scatter,
    "all_to_all": all_to_all_lists,
    "send_recv": send_recv,
    "coalesced": coalesced,
    "barrier": barrier,
    "non_contiguous": non_contiguous,
    "async": async_ops,
}


def main():
    global RANK, N, KG
    outdir, wanted = sys.argv[1], sys.argv[2:] or list(FAMILIES)
    RANK, N, KG = setup()
    rec = Recorder(outdir, RANK, N)
    times = {}
    for name in wanted:
        t0 = time.monotonic()
        FAMILIES[name](rec)
        times[name] = round(time.monotonic() - t0, 3)
        dist.barrier()
    rec.write(family_seconds=times)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
