"""Writes that land whole or fail: ``os.write`` and ``os.pwrite`` may write fewer bytes than asked.

A filesystem with less room than a write needs (tmpfs, ext4, NFS near quota) takes what fits
and returns the count; only the next call fails with ENOSPC. A caller that ignores the count
believes bytes landed that did not, and a journal copy with a hole of zeros in it reads as
rows never written, with no sign of loss. These loop until every byte is written, and raise
the ``OSError`` that stops them (a write that takes nothing is ENOSPC).
"""

from __future__ import annotations

import errno
import os


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> None:
    """Write all of ``data`` to ``fd`` (at ``offset`` with ``pwrite``, else where it stands)."""
    view = memoryview(data)
    while view:
        done = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        if done <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[done:]
        if offset is not None:
            offset += done
