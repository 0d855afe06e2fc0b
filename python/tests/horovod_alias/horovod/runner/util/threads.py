"""horovod.runner.util.threads.in_thread (test/utils/common.py imports it)."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Runs `target(*args)` in a new thread (a daemon by default) and
    returns the thread."""
    def run():
        try:
            target(*args)
        except BaseException:  # noqa: B902
            if not silent:
                raise
    t = threading.Thread(target=run, name=name, daemon=daemon)
    t.start()
    return t
