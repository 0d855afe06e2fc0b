"""DDP keeps training through a lost worker and its replacement, without
restarting the others (workers/elastic_ddp.py, under `kungfu-run -np 4
--on-failure replace`): one worker, chosen with the step by a seeded RNG
(`KUNGFU_TEST_SEED` picks another), SIGKILLs itself between its forward
and backward passes. Checked: the survivors' pending allreduce failed
naming the lost rank, within the peer timeout of the kill; they trained
on as 3 and took in a replacement; the three healthy processes are the
ones that started (never restarted); every worker that finished holds
bit-identical parameters and optimizer state; and in every epoch each
sample went into exactly one committed step.
"""

import json
import os
import random

NP = 4
EPOCHS, N = 2, 120
PEER_TIMEOUT_S = 1.5


def test_ddp_trains_through_a_kill_and_a_replacement(launcher, tmp_path):
    seed = int(os.environ.get("KUNGFU_TEST_SEED", "48"))
    rng = random.Random(seed)
    victim, kill_step = rng.randrange(NP), rng.randrange(3, 12)
    job = launcher("workers/elastic_ddp.py", NP, tmp_path, victim, kill_step, log_dir=tmp_path,
                   launcher_args=["--on-failure", "replace"], timeout=200)
    what = f"(seed {seed}: victim {victim}, step {kill_step})\n{job.shown()}"
    starts = [json.loads(p.read_text()) for p in tmp_path.glob("start-*.json")]
    finals = [json.loads(p.read_text()) for p in tmp_path.glob("final-*.json")]
    killed = json.loads((tmp_path / "killed.json").read_text())
    first = {s["pid"]: s for s in starts if not s["joined"]}
    assert sorted(s["rank"] for s in first.values()) == list(range(NP)), what
    assert killed["pid"] == next(p for p, s in first.items() if s["rank"] == victim), what
    # the three healthy processes finished, and one replacement with them
    healthy = sorted(p for p, s in first.items() if s["rank"] != victim)
    assert sorted(f["pid"] for f in finals if not f["joined"]) == healthy, what
    joiners = [f for f in finals if f["joined"]]
    assert len(joiners) == 1 and len(finals) == NP, what
    assert all(f["size"] == NP for f in finals), what
    # one state everywhere, to the bit
    assert len({f["digest"] for f in finals}) == 1, what
    assert len({json.dumps(f["log"]) for f in finals}) == 1, what
    # each survivor recovered once, from an error naming the lost rank,
    # seen within the peer timeout of the kill
    for f in finals:
        if f["joined"]:
            continue
        (r,) = f["recoveries"]
        assert "[KF_ERR_PEER_LOST]" in r["error"], r["error"]
        assert f"rank {killed['rank']} is lost" in r["error"], r["error"]
        assert r["failed_at"] - killed["at"] < PEER_TIMEOUT_S, (r, killed)
        assert r["size"] == NP - 1, r
    # as 3, then as 4 again; every sample once per epoch
    log = finals[0]["log"]
    sizes = [size for _, _, size, _ in log]
    assert NP - 1 in sizes, sizes
    assert [e[1] for e in log] == list(range(1, len(log) + 1)), "steps in order, none twice"
    for epoch in range(EPOCHS):
        seen = [i for e, _, _, batch in log if e == epoch for i in batch]
        assert sorted(seen) == list(range(N)), f"epoch {epoch}: {len(seen)} samples"
    rec = [f["recoveries"][0] for f in finals if not f["joined"]]
    print(f"\nseed {seed}: rank {victim} killed at step {kill_step}; the others saw it "
          f"{max(r['failed_at'] - killed['at'] for r in rec):.3f} s later and went on as 3 "
          f"{max(r['recovered_at'] - r['failed_at'] for r in rec):.3f} s after that; "
          f"{len(log)} steps, sizes {sorted(set(sizes))}, one digest on {len(finals)} workers")
