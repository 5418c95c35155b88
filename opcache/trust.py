"""Which folders and files of a cache opcache may trust.

A cache folder that others can write to is a place where someone can plant a
kernel (rapidsai/cudf#4857).  Below the configured root, every folder down to
an entry, and every file of an entry, must be owned by the current user or
root and not writable by others; in a group-shared cache, group-writable
folders and files of the configured group are trusted too.
"""

from __future__ import annotations

import os
import stat

from .fsutil import Modes

_UID = os.geteuid()


class UntrustedFolder(OSError):
    """A part of the cache fails the trust rule; the message says which and why.

    An OSError, so that every path that survives an unreadable or unwritable
    cache (compile anyway, warn once) survives an untrusted one the same way.
    """


def problem(st: os.stat_result, modes: Modes) -> str | None:
    """Why something with this ``lstat``/``fstat`` result may not be trusted, or None."""
    group_ok = modes.group is not None and st.st_gid == modes.group
    if st.st_uid not in (_UID, 0) and not group_ok:
        return f"owned by uid {st.st_uid}, not by you or root"
    if st.st_mode & stat.S_IWOTH:
        return "writable by others"
    if st.st_mode & stat.S_IWGRP and not group_ok:
        if modes.group is None:
            return "writable by its group (set OPCACHE_SHARED_GROUP for a group-shared cache)"
        return f"writable by group {st.st_gid}, not the cache's group {modes.group}"
    return None


def check(st: os.stat_result, modes: Modes, what: object) -> None:
    """Raise UntrustedFolder naming ``what`` when the trust rule fails."""
    reason = problem(st, modes)
    if reason is not None:
        raise UntrustedFolder(f"{what} is {reason}")
