"""Summarizes one run of Horovod's test_torch.py under kungfu-run (the
rank<R>.jsonl and exit.rank<R> files of kungfu_hvd_plugin):

    python kungfu_hvd_summary.py RESULTS_DIR NP

prints (and writes to RESULTS_DIR/results.txt) one line per test,
`outcome  group  test  reason`, where a test's outcome is the worst over
the ranks (failed on any rank is failed; not finished on a rank, a hang or
a crash, is failed too) and its group is GPU, process-set, Adasum or
other; then the counts. Exits 1 if a test outside GPU/process-set/Adasum
failed, if pytest collected no test (exit status 5) or ended abnormally on
some rank, else 0.
"""

import json
import os
import sys

GPU_TESTS = {"test_model_parallelism", "test_horovod_sync_batch_norm"}
GROUPS = ("other", "GPU", "process-set", "Adasum")


def group(test):
    if "gpu" in test or test in GPU_TESTS:
        return "GPU"
    if "process_set" in test:
        return "process-set"
    if "adasum" in test or test == "test_delta_optimizer":
        return "Adasum"
    return "other"


def read_rank(d, r):
    """[(test, record)] in order; a test started but not finished gets
    outcome "unfinished"."""
    path = os.path.join(d, f"rank{r}.jsonl")
    if not os.path.exists(path):
        return None
    out, open_test = [], None
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec["outcome"] == "started":
                open_test = rec["test"]
                continue
            out.append((rec["test"], rec))
            open_test = None
    if open_test is not None:
        out.append((open_test, {"outcome": "unfinished", "reason": ""}))
    return out


def main(d, np_):
    problems = []
    ranks = {}
    for r in range(np_):
        recs = read_rank(d, r)
        if recs is None:
            problems.append(f"rank {r} wrote no results (it did not start pytest, or crashed "
                            "before the first test)")
            continue
        ranks[r] = dict(recs)
        order = [t for t, _ in recs]
        ranks[r]["__order__"] = order
        exit_file = os.path.join(d, f"exit.rank{r}")
        if not os.path.exists(exit_file):
            problems.append(f"rank {r}: pytest did not finish (a hang, a crash or the per-test "
                            "timeout: see the log)")
        else:
            rc = int(open(exit_file).read().strip() or -1)
            if rc == 5:
                problems.append(f"rank {r}: pytest collected no tests (exit status 5)")
            elif rc not in (0, 1):
                problems.append(f"rank {r}: pytest exit status {rc}")
    order = []
    for r in sorted(ranks):
        for t in ranks[r]["__order__"]:
            if t not in order:
                order.append(t)
    if not order:
        problems.append("no test ran")
    rows, counts = [], {}
    for t in order:
        outcome, reason = None, ""
        per = {r: ranks[r].get(t) for r in ranks}
        bad = [(r, x) for r, x in per.items()
               if x is not None and x["outcome"] in ("failed", "error")]
        unfinished = [r for r, x in per.items() if x is None or x["outcome"] == "unfinished"]
        if bad:
            r, x = bad[0]
            outcome = "failed"
            ranks_ = ",".join(str(b[0]) for b in bad)
            reason = f"rank {ranks_}: {x['reason']}"
        elif unfinished:
            outcome = "failed"
            reason = f"did not finish on rank {','.join(map(str, unfinished))} (hang or crash)"
        elif all(x["outcome"] == "skipped" for x in per.values()):
            outcome = "skipped"
            reason = next(iter(per.values()))["reason"]
        else:
            outcome = "passed"
            skipped = [r for r, x in per.items() if x["outcome"] == "skipped"]
            if skipped:
                reason = f"skipped on rank {','.join(map(str, skipped))}"
        g = group(t)
        rows.append((outcome, g, t, reason))
        counts[(g, outcome)] = counts.get((g, outcome), 0) + 1
    lines = [f"{o:8} {g:12} {t}" + (f"  -- {why}" if why else "") for o, g, t, why in rows]
    lines.append("")
    for g in GROUPS:
        c = {o: counts.get((g, o), 0) for o in ("passed", "failed", "skipped")}
        if sum(c.values()):
            lines.append(f"{g:12} passed {c['passed']:3}  failed {c['failed']:3}  "
                         f"skipped {c['skipped']:3}")
    lines.append(f"{'total':12} {len(rows)} tests on {np_} processes")
    lines += [f"problem: {p}" for p in problems]
    failed_other = [t for o, g, t, _ in rows if o == "failed" and g == "other"]
    verdict = "FAIL" if failed_other or problems else "OK"
    lines.append(f"{verdict}: {len(failed_other)} failed outside the GPU, process-set and "
                 "Adasum groups")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(d, "results.txt"), "w") as f:
        f.write(text)
    sys.stdout.write(text)
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
