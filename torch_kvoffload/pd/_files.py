"""Files another process may have planted (rendezvous records, key files, shared-memory regions): opened
read-only without following a symbolic link, then the opened file checked — its type, that the effective
user owns it, and that none of the forbidden permission bits is set."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["GROUP_OTHER_ACCESS", "GROUP_OTHER_WRITE", "check_owned", "open_owned"]

#: Mode bits a shared record or directory must not have: another user could rewrite it.
GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
#: Mode bits a secret must not have: another user could read or rewrite it.
GROUP_OTHER_ACCESS = 0o077


def check_owned(
    what: str, path: str, st: os.stat_result, *, directory: bool = False, forbid: int = 0
) -> None:
    """Raise :class:`PermissionError` naming ``what`` and ``path`` unless ``st`` (an ``fstat`` of the opened
    ``path``) is a directory / regular file owned by the effective user with none of the mode bits
    ``forbid``."""
    kind = "directory" if directory else "regular file"
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        raise PermissionError(f"{what}: {path} is not a {kind} (mode {stat.filemode(st.st_mode)})")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise PermissionError(
            f"{what}: {path} is owned by uid {st.st_uid}, not by the current user (uid {uid}); another user's "
            "file could redirect or read the transfer — remove it or choose another location"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & forbid:
        access = "writable" if forbid == GROUP_OTHER_WRITE else "readable or writable"
        raise PermissionError(
            f"{what}: {path} is {access} by its group or others (mode {mode:04o}, {oct(mode)}); expected none "
            f"of the bits {forbid:03o} (e.g. chmod {'0700' if directory else '0600'})"
        )


def open_owned(path: str, what: str, *, forbid: int = 0, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``path`` (relative to ``dir_fd`` when given), opened
    without following a link or blocking on a FIFO, after :func:`check_owned`. ``PermissionError`` for a
    link or a file that fails the check; other ``OSError`` (``FileNotFoundError``) pass through."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(f"{what}: {path} is a symbolic link; refusing to follow it") from None
        raise
    try:
        check_owned(what, path, os.fstat(fd), forbid=forbid)
    except BaseException:
        os.close(fd)
        raise
    return fd
