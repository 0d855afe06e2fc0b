"""torch's reconfigure contract on the kungfu backend, as torch's own
fault-tolerance suite (test_c10d_fault_tolerance.py) drives it and beyond:
workers that no launcher connected (their kungfu-run identity is removed
from the environment first) make the default group with
`enable_reconfigure=True` over a FileStore, trade handles through it, and
reconfigure: all of them, the last or the middle one left out, one each
and back, split in two and merged, after an abort, with an op in flight;
collectives, send/recv, a subgroup and a DeviceMesh after it; and bad
input (a reused uuid, a handle of another job, a list without this worker
or naming one twice).

    kungfu-run -np 3 python reconfigure_worker.py OUTDIR

Each rank writes OUTDIR/rank<R>.json: {check: [ok, detail]}.
"""

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

# a worker no launcher placed: only the test's rank and size are kept
RANK, SIZE = int(os.environ["KUNGFU_RANK"]), int(os.environ["KUNGFU_SIZE"])
for k in list(os.environ):
    keep = k in ("KUNGFU_TEST_JOB", "KUNGFU_LIB", "KUNGFU_INCLUDE", "KUNGFU_TORCH_BUILD_DIR")
    if (k.startswith("KUNGFU_") and not keep) or k in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "GROUP_RANK", "ROLE_RANK"):
        del os.environ[k]
# a lost peer is seen in a second (the in-flight case below)
os.environ["KUNGFU_PEER_TIMEOUT_MS"] = "1000"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import kungfu.torch  # noqa: E402,F401  registers "kungfu"

OUT = Path(sys.argv[1])
T = timedelta(seconds=30)
checks = {}


def check(name, ok, detail=""):
    checks[name] = [bool(ok), str(detail)]


def raises(name, fn, says):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  any error; its text is checked
        check(name, says in str(e), str(e)[:400])
        return
    check(name, False, "did not raise")


store = dist.FileStore(str(OUT / "store"), SIZE)


def handles(key):
    store.set(f"{key}/{RANK}", dist._get_reconfigure_handle())
    return [store.get(f"{key}/{r}").decode() for r in range(SIZE)]


def barrier(key):
    store.set(f"{key}/{RANK}", "1")
    for r in range(SIZE):
        store.get(f"{key}/{r}")


def reconfigure(uuid, hs):
    dist._reconfigure(uuid, hs, timeout=T).wait()


def sum_of_ranks(name):
    t = torch.full((4,), dist.get_rank() + 1.0)
    dist.all_reduce(t)
    n = dist.get_world_size()
    check(name, t.tolist() == [n * (n + 1) / 2] * 4, t.tolist())


def main():
    dist.init_process_group("kungfu", store=store, rank=RANK, world_size=SIZE, timeout=T,
                            enable_reconfigure=True)
    pg = dist.distributed_c10d._get_default_group()
    backend = dist.get_backend_impl(pg, torch.device("cpu"))
    check("supports_reconfigure", dist._supports_reconfigure() and backend.supports_reconfigure)
    raises("op_before_reconfigure", lambda: dist.all_reduce(torch.ones(1)), "dist._reconfigure")
    h = handles("h0")
    check("handle_stable", dist._get_reconfigure_handle() == h[RANK])
    check("handles_distinct", len(set(h)) == SIZE, h)

    # the whole group, in order
    reconfigure(100, h)
    check("all_rank_size", (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE),
          (dist.get_rank(), dist.get_world_size()))
    sum_of_ranks("all_allreduce")
    t = torch.full((3,), RANK + 1.0)
    r = torch.zeros(3)
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    if RANK % 2 == 0:
        works = [backend.send([t], nxt, 0), backend.recv([r], prv, 0)]
    else:
        works = [backend.recv([r], prv, 0), backend.send([t], nxt, 0)]
    for w in works:
        w.wait()
    check("send_recv", r.tolist() == [prv + 1.0] * 3, r.tolist())

    # bad input: nothing changes
    raises("reused_uuid", lambda: reconfigure(100, h), "already used")
    other = "kungfu:1:0000000000000001:0000000000000000:" + "ab" * 32 + ":127.0.0.1:9"
    raises("another_job", lambda: reconfigure(110, [h[RANK], other]), "another job")
    raises("not_listed", lambda: reconfigure(111, [x for x in h if x != h[RANK]]),
           "not among")
    raises("duplicate", lambda: reconfigure(112, [h[RANK], h[RANK]]), "same worker")
    sum_of_ranks("after_refusals")

    # the last one left out, then the middle one
    for uuid, out in [(101, SIZE - 1), (103, SIZE // 2)]:
        if RANK != out:
            reconfigure(uuid, [x for i, x in enumerate(h) if i != out])
            want = RANK - (RANK > out)
            check(f"shrink{uuid}_rank", (dist.get_rank(), dist.get_world_size())
                  == (want, SIZE - 1), (dist.get_rank(), dist.get_world_size()))
            sum_of_ranks(f"shrink{uuid}_allreduce")
            b = torch.full((2,), 42.0 if dist.get_rank() == 0 else 0.0)
            dist.broadcast(b, group_src=0)
            check(f"shrink{uuid}_broadcast", b.tolist() == [42.0, 42.0], b.tolist())
        barrier(f"shrunk{uuid}")
        reconfigure(uuid + 1, h)
        sum_of_ranks(f"back{uuid}")

    # one each, then all again; two disjoint groups, then one
    reconfigure(200 + RANK, [h[RANK]])
    check("alone", (dist.get_rank(), dist.get_world_size()) == (0, 1))
    sum_of_ranks("alone_allreduce")
    barrier("alone")
    reconfigure(210, h)
    half = SIZE // 2
    mine = h[:half] if RANK < half else h[half:]
    reconfigure(220 if RANK < half else 221, mine)
    check("split_size", dist.get_world_size() == len(mine), dist.get_world_size())
    sum_of_ranks("split_allreduce")
    barrier("split")
    reconfigure(222, h)
    sum_of_ranks("merged_allreduce")

    # a subgroup and a DeviceMesh made after a reconfigure
    sub = dist.new_group([0, 1])
    if RANK in (0, 1):
        s = torch.full((2,), 10.0 * (RANK + 1))
        dist.all_reduce(s, group=sub)
        check("subgroup", s.tolist() == [30.0, 30.0], s.tolist())
    mesh = init_device_mesh("cpu", (SIZE,))
    m = torch.ones(2)
    dist.all_reduce(m, group=mesh.get_group())
    check("mesh", m.tolist() == [float(SIZE)] * 2, m.tolist())

    # an op in flight on rank 0 alone (the others never post it, and stay
    # in the cluster until rank 0 is done), failed by rank 0's reconfigure
    if RANK == 0:
        w = dist.all_reduce(torch.ones(2), async_op=True)
        reconfigure(230, [h[0]])
        raises("inflight_named", w.wait, "kf_reconfigure (uuid 230)")
    barrier("inflight")
    reconfigure(231, h)
    sum_of_ranks("after_inflight")

    # abort, then a fresh uuid brings the group back
    backend.abort()
    from torch._C._distributed_c10d import ErrorType
    check("abort_error_type", backend.get_error() == ErrorType.SUCCESS, backend.get_error())
    raises("op_after_abort", lambda: dist.all_reduce(torch.ones(1)), "no cluster")
    barrier("aborted")
    reconfigure(240, handles("h1"))
    sum_of_ranks("after_abort")
    dist.barrier()
    dist.destroy_process_group()


try:
    main()
except Exception:  # noqa: BLE001  recorded for the test, then the job fails
    check("unexpected", False, traceback.format_exc())
    raise
finally:
    (OUT / f"rank{RANK}.json").write_text(json.dumps(checks))
