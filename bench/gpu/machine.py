#!/usr/bin/env python3
"""What the machine itself moves right now, printed beside a benchmark's rows.

Weft's cross-host path runs near the machine's own limits (a host memcpy,
loopback TCP: 8-16 GB/s on the H200 machines), NCCL's socket transport far
below them (2-5 GB/s), so a machine whose memory or network is slower for a
while (another tenant, a throttled core) moves Weft's numbers and barely
NCCL's. Run before and after a table (bench/gpu/crosshost.sh machine) so
each table says what the machine could do while it ran.

Prints one line: host memcpy GB/s (64 MiB copies, best and median of 20),
loopback TCP GB/s (one stream, 256 MiB in 4 MiB writes, median of 3), a
50 us sleep's median and p99, and CPU steal since boot (per mille).
"""
import socket
import statistics
import threading
import time

MIB = 1 << 20


def memcpy_gbs():
    src = bytearray(64 * MIB)
    dst = bytearray(64 * MIB)
    mv_src, mv_dst = memoryview(src), memoryview(dst)
    rates = []
    for _ in range(20):
        t = time.perf_counter()
        mv_dst[:] = mv_src
        rates.append(64 * MIB / (time.perf_counter() - t) / 1e9)
    return max(rates), statistics.median(rates)


def tcp_gbs(total=256 * MIB, chunk=4 * MIB):
    lst = socket.socket()
    lst.settimeout(10)  # bounded: a stuck loopback fails the line, never hangs the table
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]

    def sink():
        c, _ = lst.accept()
        c.settimeout(10)
        buf = bytearray(chunk)
        got = 0
        while got < total:
            n = c.recv_into(buf)
            if n == 0:
                break
            got += n
        c.sendall(b"k")
        c.close()

    th = threading.Thread(target=sink, daemon=True)
    th.start()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    data = bytes(chunk)
    t = time.perf_counter()
    for _ in range(total // chunk):
        s.sendall(data)
    s.recv(1)
    rate = total / (time.perf_counter() - t) / 1e9
    s.close()
    th.join()
    lst.close()
    return rate


def sleep_us():
    xs = []
    for _ in range(500):
        t = time.perf_counter()
        time.sleep(50e-6)
        xs.append((time.perf_counter() - t) * 1e6)
    xs.sort()
    return xs[len(xs) // 2], xs[int(len(xs) * 0.99)]


def steal_permille():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return 1000 * v[7] // max(1, sum(v[:8]))


if __name__ == "__main__":
    best, med = memcpy_gbs()
    tcp = statistics.median(tcp_gbs() for _ in range(3))
    s50, s99 = sleep_us()
    print(
        f"machine: memcpy {best:.1f} GB/s best, {med:.1f} median; loopback TCP {tcp:.2f} GB/s;"
        f" sleep(50us) p50 {s50:.0f} p99 {s99:.0f} us; steal {steal_permille()} permille since boot"
    )
