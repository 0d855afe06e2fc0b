"""What the worker scripts share: the process groups (gloo as the default
group, the reference; kungfu as a second group over all ranks), inputs that
make results exact, comparisons, and the record of checks that each rank
writes to OUTDIR/rank<R>.json for the test to read.

A check that fails is recorded, not raised, so that one run reports every
failing case; an exception that escapes (a hang, a crash) fails the job.
"""

import json
import os
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
FLOATS = {"float32", "float64", "float16", "bfloat16"}
OPS = {
    "SUM": dist.ReduceOp.SUM,
    "AVG": dist.ReduceOp.AVG,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "PRODUCT": dist.ReduceOp.PRODUCT,
}
PRODUCT_FLOATS = [-2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0]


def setup():
    """gloo as the default group, kungfu over the same ranks: (rank, size, kg)."""
    import kungfu.torch  # noqa: F401  registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    kg = dist.new_group(backend="kungfu")
    return dist.get_rank(), dist.get_world_size(), kg


def generator(*parts) -> torch.Generator:
    """A generator seeded by `parts` (include the rank for per-rank data)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def full_range(shape, dtype, g):
    """Values over the whole range of an integer type."""
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(torch.uint8)
    if dtype == torch.int32:
        return torch.randint(-2**31, 2**31, shape, generator=g, dtype=torch.int64).to(torch.int32)
    hi = torch.randint(-2**31, 2**31, shape, generator=g, dtype=torch.int64)
    lo = torch.randint(0, 2**32, shape, generator=g, dtype=torch.int64)
    return hi * 2**32 + lo


def values(kind: str, dtype_name: str, shape, g) -> torch.Tensor:
    """Inputs by kind:

    exact   sums of up to 4 ranks are exact in every type (quarters in
            [-4, 4] for floats; |x| < 1000, or < 2^40 for int64; [0, 60] for uint8)
    prod    products of up to 4 ranks are exact (floats from
            PRODUCT_FLOATS, ints in [-3, 3], uint8 in [0, 3])
    wide    any values of the type (no NaN): for MIN, MAX and copies
    random  standard normal (float32/float64 only): compared with a tolerance
    wrap    integers over their whole range: SUM and PRODUCT wrap around
    """
    dt = DTYPES[dtype_name]
    isfloat = dtype_name in FLOATS
    shape = tuple(shape)
    if kind == "exact":
        if isfloat:
            return (torch.randint(-16, 17, shape, generator=g).to(torch.float64) / 4).to(dt)
        if dtype_name == "uint8":
            return torch.randint(0, 61, shape, generator=g).to(dt)
        bound = 2**40 if dtype_name == "int64" else 1000
        return torch.randint(-bound, bound + 1, shape, generator=g).to(dt)
    if kind == "prod":
        if isfloat:
            idx = torch.randint(0, len(PRODUCT_FLOATS), shape, generator=g)
            return torch.tensor(PRODUCT_FLOATS, dtype=torch.float64)[idx].to(dt)
        lo = 0 if dtype_name == "uint8" else -3
        return torch.randint(lo, 4, shape, generator=g).to(dt)
    if kind == "wide":
        if isfloat:
            x = torch.randn(shape, generator=g, dtype=torch.float64) * 1000
            return x.to(dt)
        return full_range(shape, dt, g)
    if kind == "random":
        assert dtype_name in ("float32", "float64"), dtype_name
        return torch.randn(shape, generator=g, dtype=dt)
    if kind == "wrap":
        assert not isfloat
        return full_range(shape, dt, g)
    raise ValueError(kind)


def sentinel_like(t: torch.Tensor, v=7) -> torch.Tensor:
    return torch.full_like(t, v)


def same(got: torch.Tensor, ref: torch.Tensor, tol=None):
    """(ok, detail): shape and type equal and every value: bit-exact
    (torch.equal) if `tol` is None, else |got - ref| <= atol + rtol * |ref|
    with tol = (rtol, atol)."""
    if not isinstance(got, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return False, f"not tensors: {type(got).__name__}, {type(ref).__name__}"
    if got.dtype != ref.dtype or got.shape != ref.shape:
        return False, f"got {got.dtype}{tuple(got.shape)}, want {ref.dtype}{tuple(ref.shape)}"
    if got.numel() == 0:
        return True, "empty"
    if tol is None:
        if torch.equal(got, ref):
            return True, "exact"
        bad = (got != ref).reshape(-1).nonzero()
        i = int(bad[0])
        return False, (f"{bad.numel()} of {got.numel()} values differ; first at "
                       f"flat index {i}: got {got.reshape(-1)[i].item()}, want "
                       f"{ref.reshape(-1)[i].item()}")
    rtol, atol = tol
    g64, r64 = got.double(), ref.double()
    diff = (g64 - r64).abs()
    worst = float(diff.max())
    okay = bool((diff <= atol + rtol * r64.abs()).all())
    return okay, f"max |diff| {worst:.3g} (rtol {rtol:g}, atol {atol:g})"


def float_tol(dtype_name: str, size: int, scale: float = 5.0):
    """A tolerance for sums/products of `size` standard-normal values in
    another order: a few units in the last place of the type."""
    eps = torch.finfo(DTYPES[dtype_name]).eps
    return (8 * size * eps, 8 * size * eps * scale)


class Recorder:
    """The checks of one rank, written to OUTDIR/rank<R>.json."""

    def __init__(self, outdir: str, rank: int, size: int):
        self.path = Path(outdir) / f"rank{rank}.json"
        self.rank, self.size = rank, size
        self.records = []
        self.t0 = time.monotonic()

    def add(self, family: str, case: str, ok: bool, detail: str = "", **extra):
        self.records.append({"family": family, "case": case, "ok": bool(ok),
                             "detail": detail, **extra})

    def compare(self, family, case, got, ref, tol=None, **extra):
        ok, detail = same(got, ref, tol)
        self.add(family, case, ok, detail, **extra)
        return ok

    def guard(self, family, case, fn):
        """Runs fn(); an exception it raises fails the case (and is kept)."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001  a failing case, not the job
            self.add(family, case, False, f"raised {type(e).__name__}: {e}\n"
                     + traceback.format_exc(limit=4))

    def write(self, **extra):
        data = {"rank": self.rank, "size": self.size, "records": self.records,
                "seconds": time.monotonic() - self.t0, **extra}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)
        bad = [r for r in self.records if not r["ok"]]
        print(f"rank {self.rank}: {len(self.records)} checks, {len(bad)} failed "
              f"({time.monotonic() - self.t0:.1f} s)", flush=True)
        for r in bad[:20]:
            print(f"  FAILED {r['family']} {r['case']}: {r['detail']}", file=sys.stderr)
