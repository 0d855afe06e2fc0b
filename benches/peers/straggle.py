#!/usr/bin/env python3
"""Waiting for a late peer: rank 1 arrives SKEW seconds late at every
all_reduce (backend "kungfu"); rank 0 prints its mean time per op beyond
the skew, and the CPU time its process spent per op (all its threads).

    PY=~/.cache/kungfu-torch-venv/bin/python
    PYTHONPATH=python target/release/kungfu-run -np 2 $PY benches/peers/straggle.py \
        [SKEW=0.005] [OPS=200] [BYTES=4096]
"""
import sys
import time

import torch
import torch.distributed as dist

import kungfu.torch  # noqa: F401  registers the backend

dist.init_process_group("kungfu")
r = dist.get_rank()
args = sys.argv[1:] + ["0.005", "200", "4096"][len(sys.argv) - 1:]
skew, n, size = float(args[0]), int(args[1]), int(args[2])
x = torch.ones(size // 4)
for _ in range(20):
    dist.all_reduce(x)
cpu0, t = time.process_time(), time.perf_counter()
for _ in range(n):
    if r == 1:
        time.sleep(skew)
    dist.all_reduce(x)
dt = (time.perf_counter() - t) / n
cpu = (time.process_time() - cpu0) / n
if r == 0:
    print(f"over {(dt - skew) * 1e6:.1f} us cpu {cpu * 1e6:.1f} us per op")
