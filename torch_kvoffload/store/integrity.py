"""Checksums of stored values: every value a store holds is checked before its bytes are used.

The checksum of a value is CRC-32 (``zlib.crc32``) of its bytes, seeded with the CRC-32 of its key, so a
value read back under another key fails too. :class:`~torch_kvoffload.store.local.LocalKVStore` keeps it
beside each entry; the remote adapters (:mod:`torch_kvoffload.store._remote`) store it in a trailer after
the value's bytes, so it travels with the value to every client of the pool::

    stored object = value bytes ‖ trailer (16 bytes) = magic b"KVc1" ‖ uint64-LE value length ‖ uint32-LE CRC

A value whose bytes do not match (a flipped byte), or whose object is not a complete trailer-sealed value
of the expected size (truncated, foreign), is a miss for the reader — never copied out — counted in the
store's ``corrupt_records`` counter and removed from the store.

Not a transfer: large batches are checksummed on a small thread pool of this module (``zlib.crc32``
releases the GIL); it only reads bytes already in place and moves no data: every copy a store makes runs
on its caller's thread (for the runtimes, a :class:`~torch_kvoffload.transfer.TransferStream`).
"""

from __future__ import annotations

import functools
import os
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["MAGIC", "TRAILER_BYTES", "checksum", "checksums", "seal", "unseal"]

# batches at least this large are checksummed on a thread pool (zlib.crc32 releases the GIL)
_PARALLEL_BYTES = 1 << 20

MAGIC = b"KVc1"
_TRAILER = struct.Struct("<4sQI")
#: Bytes a remote store appends to every value.
TRAILER_BYTES = _TRAILER.size


def _buffer(data: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU ``uint8`` tensor as a buffer (no copy)."""
    return memoryview(data.numpy()) if data.numel() else memoryview(b"")


def checksum(key: str, data: torch.Tensor) -> int:
    """CRC-32 of ``data`` (a contiguous CPU ``uint8 [n]`` tensor) seeded with ``key``'s CRC-32."""
    return zlib.crc32(_buffer(data), zlib.crc32(key.encode("utf-8")))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="kvstore-crc")


def checksums(keys: Sequence[str], data: Sequence[torch.Tensor]) -> list[int]:
    """:func:`checksum` of every ``(keys[i], data[i])``; large batches on a small thread pool."""
    if len(data) > 1 and sum(d.numel() for d in data) >= _PARALLEL_BYTES and (os.cpu_count() or 1) > 1:
        return list(_pool().map(checksum, keys, data))
    return [checksum(k, d) for k, d in zip(keys, data, strict=True)]


def seal(key: str, framed: torch.Tensor) -> None:
    """Write the trailer of ``framed`` (``uint8 [n + TRAILER_BYTES]``, the value in its first ``n`` bytes)."""
    n = framed.numel() - TRAILER_BYTES
    trailer = _TRAILER.pack(MAGIC, n, checksum(key, framed[:n]))
    framed[n:].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))


def unseal(key: str, framed: torch.Tensor) -> bool:
    """Whether ``framed`` (``uint8``, contiguous, CPU) is a complete value of ``key`` with intact bytes."""
    n = framed.numel() - TRAILER_BYTES
    if n < 0:
        return False
    magic, length, crc = _TRAILER.unpack(_buffer(framed[n:]))
    return magic == MAGIC and length == n and crc == checksum(key, framed[:n])
