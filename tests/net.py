"""What the tests read about sockets: a free loopback port, and the TCP sockets a set of processes listens on.

Invariant: read-only helpers; `free_port` binds and closes at once, `listening` only reads /proc.
"""
from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_on(pids: set[int]) -> list[str]:
    """host:port of every TCP socket in LISTEN state held by one of `pids`."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                host, port = f[1].split(":")
                out.append(f"{host}:{int(port, 16)}")
    return out


# 127.0.0.1, ::1, and ::ffff:127.0.0.1 (gRPC binds IPv4 loopback on an IPv6 socket) as /proc/net writes them
LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")
