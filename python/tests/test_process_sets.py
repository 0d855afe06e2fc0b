"""Horovod's process sets in kungfu.torch (workers/hvd_sets_worker.py), 4
processes: sets {0,2} and {1,3} with every op within them, values checked
exactly; unnamed ops and names per set; what is refused; join after set
ops; removal and ids given again; `init(process_sets=...)`."""

import json

FAMILIES = {"sets", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
            "gradient", "names", "errors", "barrier", "join", "remove", "init"}


def test_process_sets(launcher, tmp_path):
    job = launcher("workers/hvd_sets_worker.py", 4, tmp_path, log_dir=tmp_path, timeout=240)
    records = []
    for r in range(4):
        data = json.loads((tmp_path / f"rank{r}.json").read_text())
        records += [dict(x, rank=r) for x in data["records"]]
    bad = [f"rank {x['rank']}: {x['family']} {x['case']}: {x['detail']}"
           for x in records if not x["ok"]]
    assert not bad, "\n".join(bad) + "\n" + job.shown()
    seen = {x["family"] for x in records}
    assert FAMILIES <= seen, f"no checks of {sorted(FAMILIES - seen)}"
    print(f"\n{len(records)} checks over 4 ranks passed")
