"""horovod.common.util's helpers that tests use."""


def split_list(items, n):
    """`items` in n consecutive parts of nearly equal length."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def gpu_available(ext_base_name, verbose=False):
    return False
