"""Elastic training from Python, over the elastic C ABI (`kf_resize*`,
`kf_sync_state`, `kf_recover`).

    state = kungfu.torch.elastic.TorchState(model, optimizer, epoch=0)

    @kungfu.torch.elastic.run
    def train(state):
        while state.step < steps:
            ...one step...
            state.step += 1
            state.commit()      # a rollback point; follows a resize

    train(state)

`commit()` saves the state in memory and, when the job has a config
server (`kungfu-run -w`, `--on-failure shrink|replace`), applies a change
of the cluster made since (a size `kungfu.propose_new_size(n)` proposed,
a replacement of a lost worker): the workers (new ones included) leave
`commit()` with the same state. `run` turns a lost peer into a recovery:
the survivors shrink the cluster (`kungfu.recover()`), roll back to the
last commit and go on. A worker the cluster no longer holds returns from
`run` with None.

The model may be a `DistributedDataParallel` module over the kungfu
backend (`kungfu.torch.process_group.init_process_group()`): on every change the groups
of every rank take the new rank and size and the module's reducer starts
afresh. A worker that joins makes its DDP module with `init_sync=False`
(the others are not making one then); `run`'s first sync gives it the
model.
"""

from .groups import refresh_torch_groups, reset_ddp
from .sampler import ElasticSampler
from .state import (
    Detached, HostsUpdatedInterrupt, TorchState, _cluster_changed, is_peer_lost,
    resize_from_config, run,
)

__all__ = [
    "Detached", "ElasticSampler", "HostsUpdatedInterrupt", "TorchState", "is_peer_lost", "refresh_torch_groups",
    "reset_ddp", "resize_from_config", "run", "_cluster_changed",
]
