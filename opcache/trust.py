"""Which folders and files of a cache opcache may trust.

A cache folder that others can write to is a place where someone can plant a
kernel (rapidsai/cudf#4857).  Below the configured root, every folder down to
an entry, and every file of an entry, must be owned by the current user or
root and not writable by others; in a group-shared cache, group-writable
folders and files of the configured group are trusted too.  A file a person
writes (op_cache.ini) may also be writable by its owner's own group (a user
private group, of its name and no other member: where each user has one, as
on Debian, Ubuntu and Fedora, the umask is 002 and such a file is 0664).

Trusting a group's folders by their group id assumes only members can give
something that id.  A setgid folder of the group that others can write gives
it to whatever anyone makes in it, so a group-shared cache's root must not be
writable by others, nor lie below such a folder (``root_problem``).
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


def problem(st: os.stat_result, modes: Modes, *, own_group: bool = False) -> str | None:
    """Why something with this ``lstat``/``fstat`` result may not be trusted, or None.

    ``own_group``: its owner's private group may write it too (a file a person
    wrote; never asked on a hit's way: it lists every user).
    """
    group_ok = modes.group is not None and st.st_gid == modes.group
    if st.st_uid not in (_UID, 0) and not group_ok:
        return f"owned by uid {st.st_uid}, not by you or root"
    if st.st_mode & stat.S_IWOTH:
        return "writable by others"
    if (
        st.st_mode & stat.S_IWGRP
        and not group_ok
        and not (own_group and private_group(st.st_uid, st.st_gid))
    ):
        if modes.group is None:
            return "writable by its group (set OPCACHE_SHARED_GROUP for a group-shared cache)"
        return f"writable by group {st.st_gid}, not the cache's group {modes.group}"
    return None


def root_problem(root: str | os.PathLike[str], modes: Modes) -> str | None:
    """Why the root of a cache (it may be a link: judged where it leads) may not be
    used, or None.  Only a group-shared cache's root is judged (a private cache trusts no one
    else's folder below it, whatever its root): it may not be writable by others,
    and no folder above it may be setgid of the cache's group and writable by
    others, where anyone could have made the root or a folder on its way, with the
    group's id (a member's name is no proof: a pod of a Kubernetes ``fsGroup`` runs
    as any uid).  A root not made yet is judged by the folders above it.
    """
    if modes.group is None:
        return None
    path = os.path.realpath(root)
    try:
        st = os.stat(path)
    except OSError:
        pass  # (not made yet: made by us, 2770, in a folder judged below)
    else:
        if st.st_mode & stat.S_IWOTH:
            return f"{path} is writable by others, so anyone could plant a kernel there"
    while (parent := os.path.dirname(path)) != path:
        path = parent
        try:
            st = os.stat(path)
        except OSError:
            continue  # (then the root cannot be reached either)
        if st.st_mode & stat.S_IWOTH and st.st_mode & stat.S_ISGID and st.st_gid == modes.group:
            return (
                f"{path} is setgid for the cache's group {modes.group} and writable by others, "
                "so anyone could make a folder of the group's there and plant a kernel in it"
            )
    return None


def check_root(root: str | os.PathLike[str], modes: Modes) -> None:
    """Raise UntrustedFolder when ``root_problem`` finds one."""
    reason = root_problem(root, modes)
    if reason is not None:
        raise UntrustedFolder(reason)


def private_group(uid: int, gid: int) -> bool:
    """Whether ``gid`` is the user private group of ``uid``: its primary group, of its
    name, with no other member, listed or by primary group."""
    if (uid, gid) not in _private:
        import grp
        import pwd

        try:
            user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
        except (KeyError, OSError):
            _private[uid, gid] = False
        else:
            _private[uid, gid] = (
                user.pw_gid == gid
                and group.gr_name == user.pw_name
                and set(group.gr_mem) <= {user.pw_name}
                # (a group's members by their primary group are not in gr_mem)
                and not any(u.pw_gid == gid and u.pw_uid != uid for u in pwd.getpwall())
            )
    return _private[uid, gid]


_private: dict[tuple[int, int], bool] = {}


def check(st: os.stat_result, modes: Modes, what: object) -> None:
    """Raise UntrustedFolder naming ``what`` when the trust rule fails."""
    reason = problem(st, modes)
    if reason is not None:
        raise UntrustedFolder(f"{what} is {reason}")
