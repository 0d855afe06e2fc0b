"""kungfu.torch.optimizers against a single-process reference of the same
formula, and the monitors inside the gradient exchange against a known
noise scale (workers/optim_worker.py)."""

import json


def test_the_optimizers_match_a_single_process_reference(launcher, tmp_path):
    launcher("workers/optim_worker.py", 3, "optim", str(tmp_path), log_dir=tmp_path)
    for r in range(3):
        got = json.loads((tmp_path / f"optim-rank{r}.json").read_text())
        for kind in ("ssgd", "sma", "pair"):
            assert got[kind] < 1e-5, (r, kind, got)
        # the fixed schedule: peer (r + 1 + step) % 3, never itself
        for step, peers in enumerate(got["pair_peers"]):
            p = (r + 1 + step) % 3
            assert peers == [p if p != r else (p + 1) % 3], (r, step, peers)


def test_the_noise_scale_rides_on_the_exchange_and_is_right(launcher, tmp_path):
    # the op machine over TCP, whose per-peer counters these are (ops the
    # shared-memory fast path of one host takes are not counted per peer)
    launcher("workers/optim_worker.py", 2, "noise", str(tmp_path), log_dir=tmp_path,
             launcher_args=["--transport", "tcp"], env={"KUNGFU_FAST_MAX_BYTES": "0"})
    for r in range(2):
        got = json.loads((tmp_path / f"noise-rank{r}.json").read_text())
        # no collective added: the same ops per peer with the monitor as without
        assert got["ops_plain"] == got["ops_monitored"], got
        assert got["ops_plain"][0] > 0, got
        truth = got["truth"]
        for where in ("optimizer", "ddp"):
            assert abs(got[where] - truth) <= 0.2 * truth, (r, where, got[where], truth)
        assert got["ddp_grad_err"] < 1e-5, got
