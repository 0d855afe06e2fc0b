#!/usr/bin/env python3
"""Finds two op names with the same 64-bit id (FNV-1a 64, as
collectives/src/names.rs hashes them), for errors.c's duplicate-name
scenario. Prints: NAME_A NAME_B ID. Takes well under a minute.

XOR with a byte moves the state by delta in [-255, 255], fixed by the
state's low byte. Two strings of n bytes after a common prefix then end
in the same state iff sum(d_i * P^(n-i)) = 0 mod 2^64, where d_i is the
difference of their deltas at byte i. LLL finds a short such d; a
depth-first search picks printable bytes that realise it.
"""
import sys
from fractions import Fraction

P, M, OFFSET = 0x100000001B3, 1 << 64, 0xCBF29CE484222325
PREFIX = b"dup/"
ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-./"


def fnv1a64(data, h=OFFSET):
    for b in data:
        h = ((h ^ b) * P) % M
    return h


def lll(basis, delta=Fraction(3, 4)):
    """Textbook LLL on integer rows (small dimensions only)."""
    b = [list(r) for r in basis]
    m = len(b)

    def dot(u, v):
        return sum(x * y for x, y in zip(u, v))

    def gram_schmidt():
        bs, mu = [], [[Fraction(0)] * m for _ in range(m)]
        for i in range(m):
            v = [Fraction(x) for x in b[i]]
            for j in range(i):
                mu[i][j] = dot(b[i], bs[j]) / dot(bs[j], bs[j])
                v = [x - mu[i][j] * y for x, y in zip(v, bs[j])]
            bs.append(v)
        return bs, mu

    bs, mu = gram_schmidt()
    k = 1
    while k < m:
        for j in range(k - 1, -1, -1):
            q = round(mu[k][j])
            if q:
                b[k] = [x - q * y for x, y in zip(b[k], b[j])]
                bs, mu = gram_schmidt()
        if dot(bs[k], bs[k]) >= (delta - mu[k][k - 1] ** 2) * dot(bs[k - 1], bs[k - 1]):
            k += 1
        else:
            b[k], b[k - 1] = b[k - 1], b[k]
            bs, mu = gram_schmidt()
            k = max(k - 1, 1)
    return b


def realise(d, h0):
    """Two byte strings whose deltas differ by d from state h0, or None."""

    def go(i, h, g, s, t):
        if i == len(d):
            return (s, t) if h == g and s != t else None
        lo_h, lo_g = h & 255, g & 255
        for x in ALPHABET:
            dx = (lo_h ^ x) - lo_h
            for y in ALPHABET:
                if dx - ((lo_g ^ y) - lo_g) == d[i]:
                    r = go(i + 1, ((h ^ x) * P) % M, ((g ^ y) * P) % M, s + bytes([x]), t + bytes([y]))
                    if r:
                        return r
        return None

    return go(0, h0, h0, b"", b"")


def main():
    n = 12
    scale = 1 << 40
    rows = []
    for i in range(n):
        r = [0] * (n + 1)
        r[i], r[n] = 1, scale * pow(P, n - i, M)
        rows.append(r)
    rows.append([0] * n + [scale * M])
    short = [r[:n] for r in lll(rows) if r[n] == 0 and any(r[:n])]
    short.sort(key=lambda d: max(abs(x) for x in d))
    h0 = fnv1a64(PREFIX)
    for d in short:
        for sign in (1, -1):
            r = realise([sign * x for x in d], h0)
            if r:
                a, b = PREFIX + r[0], PREFIX + r[1]
                assert a != b and fnv1a64(a) == fnv1a64(b)
                print(a.decode(), b.decode(), f"{fnv1a64(a):016x}")
                return 0
    print("no pair found; try a larger n", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
