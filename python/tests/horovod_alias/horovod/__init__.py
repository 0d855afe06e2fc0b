"""A stand-in for the `horovod` package that runs Horovod's own tests
against kungfu.torch (scripts/horovod-suite.sh puts it first on
PYTHONPATH): `horovod.torch` and its submodules are kungfu.torch's (the
same module objects, not copies); `horovod.common` and
`horovod.runner.util.threads` hold the few pieces tests import.

Not a Horovod: nothing else of horovod is here.
"""

import importlib
import importlib.abc
import importlib.util
import sys


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """horovod.torch[.X] -> kungfu.torch[.X]"""

    PREFIX = "horovod.torch"

    def find_spec(self, fullname, path, target=None):
        if fullname == self.PREFIX or fullname.startswith(self.PREFIX + "."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module("kungfu.torch" + spec.name[len(self.PREFIX):])

    def exec_module(self, module):
        pass  # imported already


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())

__version__ = "0.28.1+kungfu"
