#!/usr/bin/env python3
"""What TCP over loopback allows a 2-rank ring allreduce: two processes
each send SIZE bytes to the other and receive SIZE bytes, both at once
(what a ring allreduce of SIZE bytes moves per rank at np 2: half in its
reduce-scatter, half in its allgather), with nothing else: no reduction,
no framing, no input copy. Prints the median time of ROUNDS exchanges per
process.

    benches/peers/tcp_floor.py [--size 64M] [--rounds 8]
"""
import argparse
import multiprocessing as mp
import socket
import threading
import time


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def exchange(listener, peer_port, size, rounds, out):
    c = socket.create_connection(("127.0.0.1", peer_port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    a, _ = listener.accept()
    send, recv = bytearray(size), memoryview(bytearray(size))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()

        def rx():
            got = 0
            while got < size:
                n = a.recv_into(recv[got:], size - got)
                if n == 0:
                    raise ConnectionError("peer closed")
                got += n

        th = threading.Thread(target=rx)
        th.start()
        c.sendall(send)
        th.join()
        times.append(time.perf_counter() - t)
    out.put(sorted(times)[len(times) // 2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="64M")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    size = parse_size(a.size)
    listeners = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))  # a free port each
        s.listen(1)
        listeners.append(s)
    ports = [s.getsockname()[1] for s in listeners]
    out = mp.Queue()
    procs = [
        mp.Process(target=exchange, args=(listeners[i], ports[1 - i], size, a.rounds, out))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
            raise SystemExit("an exchange did not finish within 300 s")
    ms = sorted(round(out.get(timeout=5) * 1e3, 1) for _ in range(2))
    print(f"{size} bytes each way, both at once, median of {a.rounds}: {ms[0]} and {ms[1]} ms")


if __name__ == "__main__":
    mp.set_start_method("fork")
    main()
