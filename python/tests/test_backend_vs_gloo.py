"""The "kungfu" torch.distributed backend against gloo, op by op.

One job per process count runs every op on a kungfu group and on gloo with
the same inputs (workers/ops_worker.py; every dtype of DTYPES, every
reduction, every root); each test here checks one family of its records, on
every rank. workers/errors_worker.py does the same for what the backend
refuses and for ranks that disagree.
"""

import json
from pathlib import Path

import pytest

NPS = [2, 4]
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"]
FLOATS = {"float32", "float64", "float16", "bfloat16"}
REDUCTIONS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]
OPS_FAMILIES = [
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single",
    "all_to_all_single_uneven", "all_to_all", "reduce", "gather", "scatter", "send_recv",
    "coalesced", "barrier",
    "non_contiguous",
    "async",
]
# families whose records must cover every dtype (and, for reductions, every op)
BY_DTYPE = set(OPS_FAMILIES) - {"barrier", "async"}
BY_OP = {"all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce"}
JOB_TIMEOUT = 240


def load(outdir: Path, np: int) -> list:
    records = []
    for r in range(np):
        path = outdir / f"rank{r}.json"
        assert path.is_file(), f"rank {r} wrote no results ({path})"
        data = json.loads(path.read_text())
        for rec in data["records"]:
            records.append({**rec, "rank": r})
    return records


class Jobs:
    """Runs a worker once per (script, np, args) for the whole module; a job
    that failed fails every test that needs it (the first with its output)."""

    def __init__(self, launcher, tmp_path_factory):
        self.launcher, self.tmp = launcher, tmp_path_factory
        self.done = {}

    def get(self, script, np, *args, env=None, timeout=JOB_TIMEOUT):
        key = (script, np, args)
        if key not in self.done:
            out = self.tmp.mktemp(f"{Path(script).stem}-np{np}")
            try:
                job = self.launcher(script, np, out, *args, log_dir=out, env=env,
                                    timeout=timeout)
                self.done[key] = (job, load(out, np))
            except AssertionError as e:
                self.done[key] = e
            else:
                return self.done[key]
            pytest.fail(f"the job failed:\n{self.done[key]}", pytrace=False)
        got = self.done[key]
        if isinstance(got, BaseException):
            pytest.fail(f"the job {script} -np {np} failed (see the first test that used it)",
                        pytrace=False)
        return got


@pytest.fixture(scope="module")
def jobs(launcher, tmp_path_factory):
    return Jobs(launcher, tmp_path_factory)


def failures(records) -> list:
    return [f"rank {r['rank']}: {r['family']}: {r['case']}: {r['detail']}" for r in records if not r["ok"]]


def assert_all_ok(records, what):
    assert records, f"no checks recorded for {what}"
    bad = failures(records)
    shown = "\n".join(bad[:40]) + (f"\n... and {len(bad) - 40} more" if len(bad) > 40 else "")
    assert not bad, f"{len(bad)} of {len(records)} checks of {what} failed:\n{shown}"


@pytest.mark.parametrize("family", OPS_FAMILIES)
@pytest.mark.parametrize("np", NPS)
def test_op_vs_gloo(jobs, np, family):
    _, records = jobs.get("workers/ops_worker.py", np)
    mine = [r for r in records if r["family"] == family]
    assert_all_ok(mine, f"{family} (np={np})")
    assert {r["rank"] for r in mine} == set(range(np)), "some rank recorded nothing"
    if family in BY_DTYPE:
        seen = {r.get("dtype") for r in mine}
        assert seen >= set(DTYPES), f"dtypes not covered: {set(DTYPES) - seen}"
    if family in BY_OP:
        for op in REDUCTIONS:
            want = FLOATS if op == "AVG" else set(DTYPES)
            seen = {r.get("dtype") for r in mine if r.get("op") == op}
            assert seen == want, f"{op}: dtypes covered {sorted(seen)}, want {sorted(want)}"


# ---- errors ----

ERRORS_ENV = {"KUNGFU_OP_TIMEOUT_MS": "20000"}  # a hang becomes an error, not a job timeout


@pytest.mark.parametrize("np", NPS)
@pytest.mark.parametrize("family", ["refused", "extras"])
def test_refused_and_extras(jobs, np, family):
    """Non-CPU (meta) and sparse tensors, unsupported types and reductions,
    bad sizes, ops the backend lacks: a RuntimeError on the caller's thread
    (naming the rank, for the backend's own checks); and the types beyond
    the seven that the backend takes (bool, int8, int16, complex64)."""
    _, records = jobs.get("workers/errors_worker.py", np, env=ERRORS_ENV)
    assert_all_ok([r for r in records if r["family"] == family], f"{family} (np={np})")


@pytest.mark.parametrize("np", NPS)
def test_mismatch_raises_on_every_rank(jobs, np):
    """Ranks that disagree (sizes, types, reductions, all-to-all splits):
    a RuntimeError naming the rank on every rank (through wait() and the
    Future too); the group works afterwards, and every rank's interpreter
    lives on (the job exits with 0)."""
    _, records = jobs.get("workers/errors_worker.py", np, env=ERRORS_ENV)
    mine = [r for r in records if r["family"] == "mismatch"]
    assert_all_ok(mine, f"mismatch (np={np})")
    cases = {r["case"] for r in mine if r["rank"] == 0 and not r["case"].startswith("after ")}
    for r in range(np):
        theirs = {x["case"] for x in mine if x["rank"] == r}
        assert "all_reduce: sizes" in theirs and "after all_reduce: sizes: the group works" in theirs
    assert len(cases) >= 10, sorted(cases)


@pytest.mark.parametrize("np", NPS)
def test_mismatch_rooted_on_senders(jobs, np):
    """The ranks of a broadcast, reduce or gather that only send (and every
    rank of a broadcast where each names itself the root) fail with
    KF_ERR_MISMATCH too: rooted ops end with confirmations."""
    _, records = jobs.get("workers/errors_worker.py", np, env=ERRORS_ENV)
    assert_all_ok([r for r in records if r["family"] == "mismatch_senders"],
                  f"mismatch_senders (np={np})")


@pytest.mark.parametrize("np", NPS)
def test_one_sided_error(jobs, np):
    """Rank 0 alone passes a bad size (to the group's first op): it raises
    at once, the others time out naming rank 0, and the group works after."""
    _, records = jobs.get("workers/errors_worker.py", np, "one_sided",
                          env={"KUNGFU_OP_TIMEOUT_MS": "3000"})
    assert_all_ok([r for r in records if r["family"] == "one_sided"], f"one_sided (np={np})")


@pytest.mark.parametrize("np", NPS)
def test_blocking_collective_in_a_future_callback(jobs, np):
    """A then() callback that runs blocking all_reduces and a barrier on the
    kungfu group (as it may on gloo): no deadlock (the job's timeout is
    short), right values, and a failing op raises inside the callback."""
    _, records = jobs.get("workers/errors_worker.py", np, "blocking_callback", timeout=60)
    assert_all_ok([r for r in records if r["family"] == "blocking_callback"],
                  f"blocking_callback (np={np})")
