"""Small helpers shared across the package: one place each for free ports, alignment, int arguments
and dtype names.
"""

from __future__ import annotations

import operator
import random
import socket

import torch

__all__ = [
    "DTYPE_ALIASES",
    "Unchanged",
    "check_int",
    "dtype_name",
    "free_port",
    "free_ports",
    "parse_dtype",
    "round_up",
]


#: Where the OS keeps the range of ports it hands to ``bind(port=0)`` and to outgoing connections (Linux).
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
#: The lowest port :func:`free_ports` picks below that range (the registered ports under it are left alone).
_LOWEST_PICKED = 10_000


def _picked_range() -> range | None:
    """Ports below the OS's ephemeral range, or ``None`` where that range is unknown or leaves too few."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(_LOWEST_PICKED, low) if low - _LOWEST_PICKED >= 4096 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free when asked (see :func:`free_ports`)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports on ``host`` that were free when asked.

    Picked at random below the OS's ephemeral range where it is known (Linux): a port the OS picked would be
    free only until it hands the same port to an outgoing connection made meanwhile (any process's), before
    the caller binds it. (A random pick, from ``os.urandom``: processes forked from one parent do not repeat
    each other's picks.) All sockets stay bound until every port is picked, so the ports are distinct.
    """
    check_int("free_ports", "count", count, minimum=1)
    picked = _picked_range()
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            for port in random.SystemRandom().sample(picked, 64) if picked is not None else ():
                try:
                    s.bind((host, port))
                    break
                except OSError:  # taken (or waiting out a closed connection): another pick
                    continue
            else:  # no range to pick from, or 64 picks taken: the OS's pick
                s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def round_up(n: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` (> 0) that is ``>= n``."""
    if alignment <= 0:
        raise ValueError(f"round_up: alignment must be positive, got {alignment}")
    return (n + alignment - 1) // alignment * alignment


def check_int(
    where: str,
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    """``value`` as an ``int`` (Python or NumPy integer, never a bool).

    Raises ``TypeError`` naming ``where`` and ``name`` for a non-integer, ``ValueError`` when it is below
    ``minimum`` or above ``maximum`` (both inclusive).
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise TypeError(f"{where}: {name} must be an int, got bool {value!r}")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{where}: {name} must be <= {maximum}, got {v}")
    return int(v)


#: Accepted spellings of the floating dtypes the library stores KV in -> the torch dtype.
DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}

_SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def parse_dtype(where: str, value: object, allowed: tuple[torch.dtype, ...] | None = None) -> torch.dtype:
    """A torch dtype from a dtype or one of :data:`DTYPE_ALIASES` (``"torch."`` prefix accepted).

    ``allowed`` restricts the result; anything else raises ``ValueError`` naming ``where`` and the
    accepted names.
    """
    if isinstance(value, torch.dtype):
        dtype = value
    else:
        key = str(value).strip().lower().removeprefix("torch.")
        if key not in DTYPE_ALIASES:
            raise ValueError(f"{where}: unknown dtype {value!r}; expected one of {sorted(DTYPE_ALIASES)}")
        dtype = DTYPE_ALIASES[key]
    if allowed is not None and dtype not in allowed:
        names = [dtype_name(d) for d in allowed]
        raise ValueError(f"{where}: dtype {value!r} is not supported here; expected one of {names}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a dtype (``"bf16"``, ``"fp16"``, ``"fp32"``), else torch's own (``"int8"``)."""
    return _SHORT_NAMES.get(dtype, str(dtype).removeprefix("torch."))


class Unchanged:
    """Whether a tensor is still the one watched, holding what it held then: by its version counter, or for
    an inference tensor (made under ``torch.inference_mode``, which keeps no version counter) by its values
    compared with a copy taken when watched. For state derived once from a caller's tensor and reused while
    the tensor stays as it was."""

    __slots__ = ("_copy", "_tensor", "_version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        if tensor.is_inference():
            self._version, self._copy = -1, tensor.clone()
        else:
            self._version, self._copy = tensor._version, None

    def holds(self, tensor: torch.Tensor) -> bool:
        """``tensor`` is the watched one and was not modified since."""
        if tensor is not self._tensor:
            return False
        if self._copy is not None:
            return torch.equal(tensor, self._copy)
        return tensor._version == self._version
