"""horovod.common.exceptions: HorovodInternalError is kungfu.torch's."""

from kungfu.torch import HorovodInternalError  # noqa: F401


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod elastic's; kungfu.torch.elastic handles membership itself."""

    def __init__(self, skip_sync=False):
        super().__init__()
        self.skip_sync = skip_sync
