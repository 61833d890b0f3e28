"""Byte sizes of host stores: parsing ``"4GiB"``-style sizes and checking them against physical memory."""

from __future__ import annotations

import functools
import os
import re
from typing import Any

__all__ = [
    "address_space_limit_bytes",
    "available_memory_bytes",
    "check_host_bytes",
    "parse_bytes",
    "physical_memory_bytes",
]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
}


def parse_bytes(name: str, value: Any) -> int:
    """An int, or a string such as ``"512MiB"``, ``"4GB"``, ``"1g"`` (K/M/G/T alone are binary)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a byte count, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n != int(n):
                raise ValueError(f"{name}: {value!r} is not a whole number of bytes")
            return int(n)
    raise ValueError(f"{name}: expected a byte count such as 1073741824 or '1GiB', got {value!r}")


@functools.cache
def physical_memory_bytes() -> int:
    """This machine's physical memory (``SC_PHYS_PAGES * SC_PAGE_SIZE``); ``0`` where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    """Host memory available now without swapping (Linux ``MemAvailable``; else ``SC_AVPHYS_PAGES``); ``0``
    where the OS does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def address_space_limit_bytes() -> int:
    """The process's soft ``RLIMIT_AS`` in bytes; ``0`` when unlimited or the OS does not say."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, ValueError, OSError, AttributeError):
        return 0
    return 0 if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def check_host_bytes(where: str, name: str, nbytes: int) -> None:
    """``ValueError`` naming ``name`` when ``nbytes`` of host memory exceed the machine's physical memory or
    the process's address-space limit (``RLIMIT_AS``, where set)."""
    ram = physical_memory_bytes()
    if ram and nbytes > ram:
        raise ValueError(
            f"{where}: {name} = {nbytes} bytes exceeds this machine's physical memory ({ram} bytes); "
            "it could never be allocated"
        )
    limit = address_space_limit_bytes()
    if limit and nbytes > limit:
        raise ValueError(
            f"{where}: {name} = {nbytes} bytes exceeds this process's address-space limit (RLIMIT_AS "
            f"{limit} bytes); it could never be allocated"
        )
