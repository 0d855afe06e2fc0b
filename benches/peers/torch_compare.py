#!/usr/bin/env python3
"""torch.distributed over the "kungfu" backend against gloo, in the same run.

    PY=~/.cache/kungfu-torch-venv/bin/python
    PYTHONPATH=python $PY benches/peers/torch_compare.py [--np 2 4] [--min 4] [--max 64M]
        [--rounds 5] [--budget 0.15] [--ddp-steps 20] [--bind-to auto|none|core ...]
        [--no-sweep] [--no-deep] [--torch-threads N] [--hogs N] [--json FILE]

For each process count it launches itself under `kungfu-run -np N`
($KUNGFU_RUN, default target/release/kungfu-run; build it with
`cargo build --release -p kungfu-tools --bin kungfu-run`), with
`--worker FILE` (and `--bind-to`, kungfu-run's option: by default it pins
each worker to one CPU when there are enough of them, which both backends
then share with their own threads; `none` leaves placement to the kernel,
as torchrun would). Each worker makes gloo the default group and a kungfu
group over the same ranks, and times:

- `dist.all_reduce` (f32, SUM, in place, synchronous) of each size from
  --min to --max bytes, by powers of 4: per round and backend, a loop of
  `iters` ops (the same on every rank: rank 0 picks it from a warm-up so
  that a loop lasts about --budget seconds), timed from a gloo barrier, the
  slowest rank's mean; the backends alternate, round by round, and the
  table shows the median of --rounds rounds;
- one DDP training step (forward, backward with DDP's bucketed
  all_reduces, SGD step) of the test model (python/tests/workers/model.py,
  batch 16, default buckets), the same way, in blocks of --ddp-steps steps;
  and the same step without DDP (no communication), for scale;
- steps of model.TinyTransformer with DEEP_LAYERS layers (207 parameter
  tensors, batch 8), in blocks of --ddp-steps steps, the same way: DDP
  over gloo and over kungfu; kungfu.torch's DistributedOptimizer (the
  Horovod API, its gradients fused into KUNGFU_FUSION_BYTES buckets) on
  the library's world; FSDP2 (`fully_shard` of each layer and the root,
  over a DeviceMesh of each backend's group); and the step alone.

--no-sweep skips the all_reduce sizes, --no-deep the 207-tensor steps.
With several --bind-to values the whole run is made once per value,
alternating within each.

torch runs one thread per process (torch.set_num_threads(1)) under both
backends, unless --torch-threads says otherwise: N threads, or 0 for
torch's default of a thread per core (the workers get OMP_NUM_THREADS set
to this machine's CPU count, which kungfu-run would otherwise set to 1).
--hogs N runs N processes that spin on a CPU each beside the job, for
the whole run: a machine whose cores the job does not have to itself. Rank 0's results go to FILE; the driver prints a markdown table
per N (size, gloo us, kungfu us, kungfu/gloo) and how the numbers stand
against the goals: all_reduce at most half of gloo's time at every size, a
DDP step at least as fast as gloo's. On a shared machine read the ratios
and the spread, not single numbers.

--json FILE writes the table `allreduce-ddp` (benches/peers/tables.py: the
format the docs' tables are rendered from): a row per size and one for the
DDP step, and per N the columns `Np gloo`, `Np kungfu` (us) and `ratio`
(kungfu/gloo); and every figure (each round's too) under `results`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import human  # noqa: E402
from tables import Table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
WORKERS = ROOT / "python" / "tests" / "workers"
ALLREDUCE_GOAL = 0.5   # kungfu / gloo, at most
DDP_GOAL = 1.0


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def sizes(lo: int, hi: int) -> list:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


# ---- the worker (under kungfu-run) ----

def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import kungfu.torch  # noqa: F401  registers "kungfu"
    from model import batches, make_model

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    dist.init_process_group("gloo")
    kg = dist.new_group(backend="kungfu")
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": None, "kungfu": kg}

    def agreed(x: float) -> float:
        """rank 0's value, on every rank"""
        t = torch.tensor([x], dtype=torch.float64)
        dist.broadcast(t, src=0)
        return float(t)

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def timed_loop(fn, iters: int) -> float:
        """seconds per call of fn, the slowest rank's mean over `iters`"""
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return slowest((time.perf_counter() - t0) / iters)

    result = {"np": n, "allreduce": [], "ddp": {}}
    for size in ([] if args.no_sweep else sizes(args.min, args.max)):
        x = torch.zeros(max(1, size // 4), dtype=torch.float32)
        ops = {b: (lambda g=g: dist.all_reduce(x, group=g)) for b, g in groups.items()}
        # warm-up (plans are built once per shape), then the loop length
        est = {b: timed_loop(f, 3) for b, f in ops.items()}
        iters = int(agreed(min(2000, max(3, args.budget / max(est.values())))))
        rounds = {b: [] for b in ops}
        for r in range(args.rounds):
            order = list(ops) if r % 2 == 0 else list(ops)[::-1]
            for b in order:
                rounds[b].append(timed_loop(ops[b], iters) * 1e6)
        result["allreduce"].append({
            "bytes": x.numel() * 4, "iters": iters, "rounds": rounds,
            "us": {b: statistics.median(v) for b, v in rounds.items()}})
        if rank == 0:
            print(f"all_reduce {human(x.numel() * 4):>8}: "
                  + ", ".join(f"{b} {v:9.1f} us" for b, v in result["allreduce"][-1]["us"].items()),
                  flush=True)

    # DDP: one model per backend, the same start and data
    steps = args.ddp_steps
    data = batches(rank, steps)
    models = {b: DDP(make_model(0), process_group=g) for b, g in groups.items()}
    models["local"] = make_model(0)  # no DDP, no communication
    opts = {b: torch.optim.SGD(m.parameters(), lr=0.1) for b, m in models.items()}

    def train(b):
        m, opt = models[b], opts[b]
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()

    for b in models:  # warm-up (DDP rebuilds its buckets after the first step)
        train(b)
    blocks = {b: [] for b in models}
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for b in order:
            blocks[b].append(timed_loop(lambda: train(b), 1) / steps * 1e6)
    result["ddp"] = {"steps_per_block": steps, "rounds": blocks,
                     "us": {b: statistics.median(v) for b, v in blocks.items()}}
    if rank == 0:
        print("ddp step: " + ", ".join(f"{b} {v:.1f} us" for b, v in result["ddp"]["us"].items()),
              flush=True)
    result["deep"] = None if args.no_deep else deep_steps(args, groups, kg, timed_loop)
    if rank == 0:
        if result["deep"]:
            print("deep step: " + ", ".join(f"{b} {v:.1f} us"
                                            for b, v in result["deep"]["us"].items()), flush=True)
        Path(args.worker).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def deep_steps(args, groups, kg, timed_loop) -> dict:
    """The steps of the 207-tensor transformer (see the module's doc):
    {"us": {way: median us per step}, "rounds": ..., "tensors": n}."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import kungfu.torch as hvd
    from model import DEEP_LAYERS, make_transformer, token_batches, token_loss

    hvd.init()
    rank, steps = dist.get_rank(), args.ddp_steps
    data = token_batches(rank, steps)
    models, forwards, opts = {}, {}, {}

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    for b, g in groups.items():
        m = models[f"ddp {b}"] = make_transformer(DEEP_LAYERS)
        forwards[f"ddp {b}"] = DDP(m, process_group=g)
        opts[f"ddp {b}"] = sgd(m)
    m = models["hvd kungfu"] = forwards["hvd kungfu"] = make_transformer(DEEP_LAYERS)
    opts["hvd kungfu"] = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters())
    for b, g in groups.items():
        mesh = DeviceMesh.from_group(g if g is not None else dist.group.WORLD, "cpu")
        m = make_transformer(DEEP_LAYERS)
        for layer in m.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        models[f"fsdp {b}"] = forwards[f"fsdp {b}"] = m
        opts[f"fsdp {b}"] = sgd(m)
    m = models["local"] = forwards["local"] = make_transformer(DEEP_LAYERS)
    opts["local"] = sgd(m)

    def train(w):
        f, opt = forwards[w], opts[w]
        for x, y in data:
            opt.zero_grad()
            token_loss(f, x, y).backward()
            opt.step()

    for w in forwards:  # warm-up
        train(w)
    blocks = {w: [] for w in forwards}
    for r in range(args.rounds):
        order = list(forwards) if r % 2 == 0 else list(forwards)[::-1]
        for w in order:
            blocks[w].append(timed_loop(lambda: train(w), 1) / steps * 1e6)
    return {"steps_per_block": steps, "rounds": blocks,
            "tensors": len(list(models["local"].parameters())),
            "buckets": len(opts["hvd kungfu"]._buckets),
            "us": {w: statistics.median(v) for w, v in blocks.items()}}


# ---- the driver ----

def launch(np: int, args, out: Path, bind: str) -> dict:
    launcher = Path(os.environ.get("KUNGFU_RUN") or ROOT / "target" / "release" / "kungfu-run")
    if not launcher.is_file():
        sys.exit(f"kungfu-run not found at {launcher}: cargo build --release -p kungfu-tools "
                 "--bin kungfu-run, or set KUNGFU_RUN")
    env = dict(os.environ)
    path = [str(WORKERS)]
    try:
        import kungfu  # noqa: F401  the workers import the same one
        path.append(str(Path(kungfu.__file__).resolve().parent.parent))
    except ImportError:
        path.append(str(ROOT / "python"))
    path += [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    threads = args.torch_threads or os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = str(threads)
    cmd = [str(launcher), "-np", str(np), "--timeout", "30m", "--bind-to", bind,
           "--", sys.executable,
           str(Path(__file__).resolve()), "--worker", str(out),
           "--min", str(args.min), "--max", str(args.max), "--rounds", str(args.rounds),
           "--budget", str(args.budget), "--ddp-steps", str(args.ddp_steps),
           "--torch-threads", str(args.torch_threads)]
    for flag in ("no_sweep", "no_deep"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=subprocess.STDOUT,
                       timeout=35 * 60, start_new_session=True)
    if r.returncode != 0:
        sys.exit(f"the np={np} job failed ({r.returncode})")
    return json.loads(out.read_text())


DEEP_GOAL = 0.7      # kungfu / gloo, at most, per way of training
FUSED_GOAL = 1.1     # the fused DistributedOptimizer / kungfu DDP, at most

# the deep steps: (label, kungfu's way, gloo's way)
DEEP_PAIRS = [("DDP step, 207 tensors", "ddp kungfu", "ddp gloo"),
              ("DistributedOptimizer step (vs gloo DDP)", "hvd kungfu", "ddp gloo"),
              ("FSDP step, 207 tensors", "fsdp kungfu", "fsdp gloo")]


def table(res: dict) -> str:
    lines = [f"### {res['np']} processes (kungfu-run --bind-to {res.get('bind_to', '?')})", "",
             "| size | gloo us | kungfu us | ratio (kungfu/gloo) |",
             "|---:|---:|---:|---:|"]
    for row in res["allreduce"]:
        g, k = row["us"]["gloo"], row["us"]["kungfu"]
        flag = "" if k / g <= ALLREDUCE_GOAL else " !"
        lines.append(f"| {human(row['bytes'])} | {g:.1f} | {k:.1f} | {k / g:.2f}{flag} |")
    d = res["ddp"]["us"]
    flag = "" if d["kungfu"] / d["gloo"] <= DDP_GOAL else " !"
    lines.append(f"| DDP step | {d['gloo']:.1f} | {d['kungfu']:.1f} | {d['kungfu'] / d['gloo']:.2f}{flag} |")
    lines.append(f"| (step without DDP) | {d['local']:.1f} | {d['local']:.1f} | |")
    if not res["deep"]:
        return "\n".join(lines)
    e = res["deep"]["us"]
    for label, k, g in DEEP_PAIRS:
        flag = "" if e[k] / e[g] <= DEEP_GOAL else " !"
        lines.append(f"| {label} | {e[g]:.1f} | {e[k]:.1f} | {e[k] / e[g]:.2f}{flag} |")
    lines.append(f"| (207-tensor step alone) | {e['local']:.1f} | {e['local']:.1f} | |")
    for label, k, g in DEEP_PAIRS:
        ck, cg = e[k] - e["local"], e[g] - e["local"]
        lines.append(f"| {label}, less the step alone | {cg:.1f} | {ck:.1f} | {ck / cg:.2f} |")
    return "\n".join(lines)


def json_table(results: list, args) -> Table:
    """The printed tables of all runs side by side, without the steps
    without communication, as the docs show them."""
    cols = [f"{r['np']}p {r['bind_to']}" for r in results]
    t = Table("allreduce-ddp" if results[0]["allreduce"] else "steps",
              f"all_reduce (f32, SUM, in place) and training steps, time in us, "
              f"median of {args.rounds} rounds; per run (processes, kungfu-run --bind-to): gloo, "
              "kungfu and ratio = kungfu/gloo",
              ["size" if results[0]["allreduce"] else "step"]
              + [c for col in cols for c in (f"{col} gloo", f"{col} kungfu", "ratio")],
              ["{}"] + ["{:.1f}", "{:.1f}", "{:.2f}"] * len(results))

    def cells(us, k="kungfu", g="gloo"):
        return [us[g], us[k], us[k] / us[g]]

    # every run ran the same sizes
    for i, row in enumerate(results[0]["allreduce"]):
        t.add(human(row["bytes"]), *[c for r in results for c in cells(r["allreduce"][i]["us"])])
    t.add("DDP step (SmallCNN)", *[c for r in results for c in cells(r["ddp"]["us"])])
    for label, k, g in DEEP_PAIRS if all(r["deep"] for r in results) else []:
        t.add(label, *[c for r in results for c in cells(r["deep"]["us"], k, g)])
    return t


def verdict(res: dict) -> str:
    missed = [f"{human(r['bytes'])} ({r['us']['kungfu'] / r['us']['gloo']:.2f}x gloo)"
              for r in res["allreduce"] if r["us"]["kungfu"] / r["us"]["gloo"] > ALLREDUCE_GOAL]
    d = res["ddp"]["us"]
    at = f"np={res['np']} bind-to {res['bind_to']}"
    out = []
    if res["allreduce"]:
        out.append(f"{at}: all_reduce <= {ALLREDUCE_GOAL}x gloo: "
                   + ("met at every size" if not missed else "missed at " + ", ".join(missed)))
    out.append(f"{at}: DDP step <= {DDP_GOAL}x gloo: "
               + ("met" if d["kungfu"] / d["gloo"] <= DDP_GOAL else "missed")
               + f" ({d['kungfu'] / d['gloo']:.2f}x)")
    if not res["deep"]:
        return "\n".join(out)
    e = res["deep"]["us"]
    for label, k, g in DEEP_PAIRS:
        r = e[k] / e[g]
        out.append(f"{at}: {label} <= {DEEP_GOAL}x gloo: {'met' if r <= DEEP_GOAL else 'missed'} "
                   f"({r:.2f}x)")
    r = e["hvd kungfu"] / e["ddp kungfu"]
    out.append(f"{at}: fused DistributedOptimizer within {FUSED_GOAL}x of kungfu DDP: "
               f"{'met' if r <= FUSED_GOAL else 'missed'} ({r:.2f}x, "
               f"{res['deep']['buckets']} buckets)")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, nargs="+", default=[2, 4])
    p.add_argument("--min", type=parse_size, default=4)
    p.add_argument("--max", type=parse_size, default=64 << 20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.15, help="seconds per timed loop (about)")
    p.add_argument("--ddp-steps", type=int, default=20)
    p.add_argument("--bind-to", nargs="+", default=["auto"], choices=["auto", "none", "core"],
                   help="kungfu-run's CPU pinning of the workers (one run per value)")
    p.add_argument("--no-sweep", action="store_true", help="skip the all_reduce sizes")
    p.add_argument("--no-deep", action="store_true", help="skip the 207-tensor steps")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch's intra-op threads per process (0: torch's default, one per core)")
    p.add_argument("--hogs", type=int, default=0,
                   help="processes spinning on a CPU each beside the job")
    p.add_argument("--json", help="write the table, and every figure, here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results = []
    setting = "".join([f", torch threads {args.torch_threads or 'default'}"
                       if args.torch_threads != 1 else "",
                       f", {args.hogs} CPU hogs" if args.hogs else ""])
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             start_new_session=True) for _ in range(args.hogs)]
    try:
        with tempfile.TemporaryDirectory(prefix="torch-compare-") as tmp:
            for np in args.np:
                for bind in args.bind_to:
                    out = Path(tmp) / f"np{np}-{bind}.json"
                    results.append({**launch(np, args, out, bind), "bind_to": bind + setting})
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    print("\n\n".join(table(r) for r in results))
    print()
    print("\n".join(verdict(r) for r in results))
    if args.json:
        write_json(args.json, [json_table(results, args)], results=results, rounds=args.rounds,
                   budget=args.budget, ddp_steps=args.ddp_steps, bind_to=args.bind_to,
                   torch_threads=args.torch_threads, hogs=args.hogs)


if __name__ == "__main__":
    main()
