"""Process groups over subsets of the ranks on the kungfu backend
(workers/groups_worker.py): `new_group`, `new_subgroups`, every collective
and point to point within groups, ranks in two groups issuing their ops in
either order. Every result equals gloo's (the inputs are small integers).
"""

import json

import pytest


def results(launcher, tmp_path, backend):
    launcher("workers/groups_worker.py", 4, backend, tmp_path, log_dir=tmp_path,
             name=f"groups-{backend}")
    return [json.loads((tmp_path / f"{backend}-rank{r}.json").read_text()) for r in range(4)]


def test_groups_match_gloo(launcher, tmp_path):
    gloo = results(launcher, tmp_path, "gloo")
    kungfu = results(launcher, tmp_path, "kungfu")
    for r, (want, got) in enumerate(zip(gloo, kungfu)):
        assert sorted(got) == sorted(want), f"rank {r}: other results"
        for k in want:
            assert got[k] == want[k], f"rank {r}: {k}: {got[k]} != gloo's {want[k]}"
    # some of them, worked out by hand
    assert kungfu[0]["all/all_reduce"] == [6.0]
    assert kungfu[0]["0-2-3/any_source"] == [[2, 22.0], [3, 33.0]]
    assert kungfu[3]["1-3/recv"] == [1.0, 1.0, 1.0]
    assert kungfu[1]["0-1/broadcast"] == kungfu[0]["0-1/broadcast"]
    print(f"\n{sum(len(r) for r in kungfu)} results over 4 ranks equal gloo's")
