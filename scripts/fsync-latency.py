#!/usr/bin/env python3
"""fdatasync latency of small appends on this disk, three ways: into a segment
preallocated with posix_fallocate (what the log does), into one filled with zeros, and
appending to a growing file. Usage: scripts/fsync-latency.py [DIR] (default: target/)."""
import os
import sys
import time


def bench(path, mode, n=2000, record=300, size=64 << 20):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if mode == "fallocate":
            os.posix_fallocate(fd, 0, size)
        elif mode == "zeros":
            zeros = b"\0" * (1 << 20)
            for i in range(size >> 20):
                os.pwrite(fd, zeros, i << 20)
        os.fsync(fd)
        buf, offset, took = b"x" * record, 4096, []
        for _ in range(n):
            started = time.perf_counter()
            os.pwrite(fd, buf, offset)
            os.fdatasync(fd)
            took.append(time.perf_counter() - started)
            offset += record
    finally:
        os.close(fd)
        os.unlink(path)
    took.sort()
    return took[len(took) // 2] * 1e6, took[int(len(took) * 0.99)] * 1e6


directory = sys.argv[1] if len(sys.argv) > 1 else "target"
for mode in ("fallocate", "zeros", "append"):
    p50, p99 = bench(os.path.join(directory, "fsync-latency.tmp"), mode)
    print(f"{mode:9} p50 {p50:5.0f} us   p99 {p99:5.0f} us")
