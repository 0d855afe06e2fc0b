"""A script may end right after its last op, without destroying its
process group: the interpreter must exit cleanly (status 0), every time."""


def test_exit_right_after_ops_is_clean(launcher, tmp_path):
    for i in range(8):
        job = launcher("workers/exit_after_op.py", 2, log_dir=tmp_path, name=f"exit{i}")
        assert "rank 1: exiting" in job.output, job.shown()
