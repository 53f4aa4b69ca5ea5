"""What every bench script prints about the machine it ran on, and a free loopback port.

The scripts run as ``python bench/<name>.py``, so this module is importable as ``machine``.
"""

from __future__ import annotations

import platform
import socket
from pathlib import Path


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), or the architecture where it is unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    """Total memory in GiB (/proc/meminfo), None where it cannot be read."""
    try:
        return int(Path("/proc/meminfo").read_text().split()[1]) / 1024**2
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
