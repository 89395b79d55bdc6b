"""Reading the files the command line is given: regular files only, bounded in size.

A path the user names may be anything: a FIFO (opening it for reading waits for a writer,
forever), a link to ``/dev/zero`` (reads never end), a file that grows while it is read.
Each is refused with one ``InvalidSpecError`` naming the flag, before anything waits or reads
without bound.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from attn_dispatch._errors import InvalidSpecError

__all__ = ["read_regular"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def read_regular(
    path: Path, flag: str, limit: int, *, what: str = "such a file", shown: str | None = None
) -> bytes:
    """The bytes of the regular file at ``path`` (links followed), at most ``limit`` of them.

    Raises ``InvalidSpecError`` (field ``flag``, value ``shown`` or the path) for a path that
    is not a regular file, one larger than ``limit``, or one that cannot be read; a missing
    file raises ``FileNotFoundError`` (callers decide what a missing file means)."""
    value = shown if shown is not None else str(path)
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer; the type is checked on the
        # opened descriptor, so the file cannot be swapped between the check and the read.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InvalidSpecError(flag, value, f"cannot read it: {exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidSpecError(
                flag,
                value,
                f"cannot read it: {path.name} is {_kind(info.st_mode)}, not a regular file; "
                "the command line reads regular files only",
            )
        if info.st_size > limit:
            raise InvalidSpecError(
                flag,
                value,
                f"{path.name} holds {info.st_size} bytes; {what} is far smaller (limit {limit})",
            )
        chunks, total = [], 0
        while True:  # bounded even if the file grows while it is read
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise InvalidSpecError(
                    flag, value, f"{path.name} grew past {limit} bytes while it was read"
                )
        return b"".join(chunks)
    except OSError as exc:
        raise InvalidSpecError(flag, value, f"cannot read it: {exc}") from None
    finally:
        os.close(fd)
