"""Elastic training from Python (kungfu.torch.elastic): the cluster grows
2 -> 3 and shrinks 3 -> 2 under `kungfu-run -w`, with the model, the
optimizer's state and the extras intact on every worker at every step
(workers/elastic_train.py checks them; this checks how the job ended)."""


def test_elastic_run_grows_and_shrinks_with_its_state(launcher, tmp_path):
    job = launcher("workers/elastic_train.py", 2, launcher_args=["-w"], log_dir=tmp_path)
    t = job.output
    assert "kungfu-run: cluster version 1: 3 workers" in t, job.shown()
    assert "kungfu-run: cluster version 2: 2 workers" in t, job.shown()
    assert "kungfu elastic: a worker left at step 14" in t, job.shown()
    for r in range(2):
        line = (f"kungfu elastic: rank {r} of 2 finished step 20, version 2, "
                "sizes seen [2, 3]")
        assert line in t, job.shown()


def test_elastic_run_recovers_from_a_lost_worker(launcher, tmp_path):
    job = launcher("workers/elastic_train.py", 3, "kill", log_dir=tmp_path,
                   launcher_args=["--on-failure", "shrink"])
    t = job.output
    for r in range(2):
        line = (f"kungfu elastic: rank {r} of 2 finished step 20, version 1, "
                "sizes seen [2, 3]")
        assert line in t, job.shown()
