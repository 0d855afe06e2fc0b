"""torch's process-group reconfigure on the kungfu backend
(workers/reconfigure_worker.py): the cases of PyTorch's own
test_c10d_fault_tolerance.py (run in full by scripts/torch-ft-suite.sh)
and the bad input and faults around them. Three workers that no launcher
connected make one group, shrink by the last and by the middle one, go
down to one each and back, split and merge, abort and come back; every
collective, send/recv, a subgroup and a DeviceMesh work after it; a
reused uuid, a handle of another job, a list without this worker or
naming one twice are refused by name; an op in flight fails naming the
reconfigure that ended it.
"""

import json

NP = 3


def test_reconfigure_contract(launcher, tmp_path):
    launcher("workers/reconfigure_worker.py", NP, tmp_path, log_dir=tmp_path, timeout=180)
    for r in range(NP):
        checks = json.loads((tmp_path / f"rank{r}.json").read_text())
        failed = {k: v[1] for k, v in checks.items() if not v[0]}
        assert not failed, f"rank {r}: {failed}"
        # every rank ran the cases meant for it (the in-flight op: rank 0)
        want = {"all_allreduce", "send_recv", "reused_uuid", "another_job", "not_listed",
                "duplicate", "alone_allreduce", "merged_allreduce", "mesh", "after_abort"}
        if r in (0, 1):
            want.add("subgroup")
        if r == 0:
            want.add("inflight_named")
        assert want <= set(checks), f"rank {r}: missing {want - set(checks)}"
    print(f"\n{len(checks)} checks per rank passed on {NP} ranks")
