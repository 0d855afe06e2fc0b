"""Process groups over subsets of the ranks, on one backend:

    kungfu-run -np 4 python groups_worker.py BACKEND OUTDIR

- `new_group` over {0,1}, {2,3}, {1,3} and {3,2,0} (torch sorts ranks):
  every member runs all_reduce, broadcast (from the group's last member),
  all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single,
  gather and scatter to the first member, and a barrier in each of its
  groups; ranks in two groups start the ops of both asynchronously, odd
  ranks in the other order;
- send/recv between the two members of {1,3}, and recv from any source in
  {3,2,0} (torch's src=None) naming the sender;
- `new_subgroups(2)`: all_reduce in this rank's subgroup;
- a group of every rank in another order than the default one's.

Writes OUTDIR/<BACKEND>-rank<R>.json: every result, by a name that says
which group and op, as lists of numbers (the test compares kungfu's with
gloo's, which must be equal: the inputs are small integers).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import kungfu.torch  # noqa: F401  registers "kungfu"


def main():
    backend, outdir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    me, n = dist.get_rank(), dist.get_world_size()
    assert n == 4
    out = {}
    sets = [[0, 1], [2, 3], [1, 3], [3, 2, 0]]
    groups = [dist.new_group(s) for s in sets]  # every rank makes every group
    mine = [(s, g) for s, g in zip(sets, groups) if me in s]

    pending = []
    for s, g in (mine[::-1] if me % 2 else mine):
        key = "-".join(map(str, sorted(s)))
        k = len(s)
        x = torch.arange(4 * k, dtype=torch.float32) + 100 * me
        a = x.clone()
        pending.append((f"{key}/all_reduce", a, dist.all_reduce(a, group=g, async_op=True)))
        b = x.clone()
        src = max(s)
        pending.append((f"{key}/broadcast", b,
                        dist.broadcast(b, src=src, group=g, async_op=True)))
        ag = torch.empty(k * x.numel())
        pending.append((f"{key}/all_gather", ag,
                        dist.all_gather_into_tensor(ag, x, group=g, async_op=True)))
        rs = torch.empty(4)
        pending.append((f"{key}/reduce_scatter", rs,
                        dist.reduce_scatter_tensor(rs, x, group=g, async_op=True)))
        a2a = torch.empty_like(x)
        pending.append((f"{key}/all_to_all", a2a,
                        dist.all_to_all_single(a2a, x, group=g, async_op=True)))
    for name, t, w in pending:
        w.wait()
        out[name] = t.tolist()

    # blocking ops: in one order everywhere (else they wait in a cycle)
    for s, g in mine:
        key = "-".join(map(str, sorted(s)))
        first = min(s)
        x = torch.tensor([float(me), 10.0 * me])
        got = [torch.empty(2) for _ in s] if me == first else None
        dist.gather(x, got, dst=first, group=g)
        if me == first:
            out[f"{key}/gather"] = [t.tolist() for t in got]
        pieces = [torch.tensor([float(i), 7.0]) for i in range(len(s))] if me == first else None
        y = torch.empty(2)
        dist.scatter(y, pieces, src=first, group=g)
        out[f"{key}/scatter"] = y.tolist()
        dist.barrier(group=g)

    # point to point: global ranks, within groups
    g13 = groups[2]
    if me in (1, 3):
        t = torch.tensor([float(me)] * 3)
        if me == 1:
            dist.send(t, dst=3, group=g13)
            r = torch.empty(3)
            dist.recv(r, src=3, group=g13)
        else:
            r = torch.empty(3)
            dist.recv(r, src=1, group=g13)
            dist.send(t, dst=1, group=g13)
        out["1-3/recv"] = r.tolist()
    g023 = groups[3]
    if me in (0, 2, 3):
        if me == 0:
            got = []
            for _ in range(2):
                r = torch.empty(1)
                sender = dist.recv(r, group=g023)  # from any member
                got.append([sender, r.item()])
            out["0-2-3/any_source"] = sorted(got)
        else:
            dist.send(torch.tensor([float(me * 11)]), dst=0, group=g023)

    sub, _ = dist.new_subgroups(group_size=2)
    s = torch.tensor([float(me + 1)])
    dist.all_reduce(s, group=sub)
    out["subgroups/all_reduce"] = s.tolist()

    everyone = dist.new_group([3, 1, 0, 2])
    e = torch.tensor([float(me)])
    dist.all_reduce(e, group=everyone)
    out["all/all_reduce"] = e.tolist()

    (outdir / f"{backend}-rank{me}.json").write_text(json.dumps(out, sort_keys=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
