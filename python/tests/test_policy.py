"""KungFu's adaptation in PyTorch (kungfu.torch.policy, ElasticSampler):
actions proposed on one rank are applied by every rank at the same step,
and an elastic run sees every sample once per epoch across batch-size
changes and a resize 2 -> 3 -> 2 (workers/policy_worker.py)."""

import json
import struct

STRATEGY_RING = 2
CUSTOM_LEARNING_RATE, CUSTOM_SYNC = 0xF001, 0xF002


def _f64(bits):
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def test_one_rank_proposes_every_rank_applies_at_the_same_step(launcher, tmp_path):
    launcher("workers/policy_worker.py", 3, "agree", str(tmp_path), log_dir=tmp_path)
    runs = [json.loads((tmp_path / f"agree-rank{r}.json").read_text()) for r in range(3)]
    # the same actions at the same steps, and the same settings at every step
    for r in (1, 2):
        assert runs[r]["history"] == runs[0]["history"], (r, runs[r]["history"])
        mine = [(s["step"], s["lr"], s["sync"]) for s in runs[r]["steps"]]
        assert mine == [(s["step"], s["lr"], s["sync"]) for s in runs[0]["steps"]]
    agreed = {(s, kind, ck): v for s, kind, v, ck in runs[0]["history"]}
    assert agreed[(2, "set_strategy", 0)] == STRATEGY_RING, agreed
    assert agreed[(3, "set_batch_size", 0)] == 3, agreed
    assert _f64(agreed[(4, "custom", CUSTOM_LEARNING_RATE)]) == 0.05, agreed
    assert agreed[(5, "custom", CUSTOM_SYNC)] == 2, agreed
    assert agreed[(6, "custom", CUSTOM_SYNC)] == 1, agreed
    # rank 0 alone against ranks 1 and 2: the majority's value
    assert agreed[(7, "set_batch_size", 0)] == 5, agreed
    assert len(agreed) == 6, agreed
    for run in runs:
        last = run["steps"][-1]["step"]
        for s in run["steps"]:
            k = s["step"]
            want = 2 if k < 3 else 3 if k < 7 else 5
            # (the epoch's last batch may be short, or hold a remainder)
            assert s["batch"] == want or (k == last and s["batch"] <= want + 1), (k, s)
            assert s["lr"] == (0.1 if k < 4 else 0.05), (k, s)
            assert s["sync"] == ("sma" if k == 5 else "ssgd"), (k, s)


def test_the_elastic_sampler_sees_every_sample_once_across_resizes(launcher, tmp_path):
    job = launcher("workers/policy_worker.py", 2, "sampler", str(tmp_path), log_dir=tmp_path,
                   launcher_args=["-w"])
    assert "cluster version 1: 3 workers" in job.output, job.shown()
    assert "cluster version 2: 2 workers" in job.output, job.shown()
    runs = [json.loads(p.read_text()) for p in tmp_path.glob("sampler-pid*.json")]
    assert len(runs) == 3, job.shown()
    assert sum(r["detached"] for r in runs) == 1, job.shown()
    sizes = {s["size"] for r in runs for s in r["steps"]}
    assert sizes == {2, 3}, sizes
    batches = {s["batch"] for r in runs for s in r["steps"]}
    assert {4, 6, 3} <= batches, batches
    for epoch in range(3):
        seen = sorted(i for r in runs for e, idx in r["seen"] if e == epoch for i in idx)
        assert seen == list(range(97)), (epoch, len(seen), len(set(seen)))
