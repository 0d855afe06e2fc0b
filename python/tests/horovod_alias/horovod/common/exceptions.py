"""horovod.common.exceptions: HorovodInternalError and
HostsUpdatedInterrupt are kungfu.torch's."""

from kungfu.torch import HorovodInternalError  # noqa: F401
from kungfu.torch.elastic import HostsUpdatedInterrupt  # noqa: F401
