"""Which folders and files of a cache opcache may trust.

A cache folder that others can write to is a place where someone can plant a
kernel (rapidsai/cudf#4857).  Below the configured root, every folder down to
an entry, and every file of an entry, must be owned by the current user or
root and not writable by others; in a group-shared cache, group-writable
folders and files of the configured group are trusted too.  A file a person
writes (op_cache.ini) may also be writable by its owner's own group (a user
private group, of its name and no other member: where each user has one, as
on Debian, Ubuntu and Fedora, the umask is 002 and such a file is 0664).

The way to a root is judged too: a link on it is followed only if it is this
user's or root's (``resolve_root``, ``open_root``).  Another user's link could
lead into a folder of this user's, which the rule above passes.

Trusting a group's folders by their group id assumes only members can give
something that id.  A setgid folder of the group that others can write gives
it to whatever anyone makes in it, so a group-shared cache's root must not be
writable by others, nor lie below such a folder (``root_problem``).
"""

from __future__ import annotations

import errno
import os
import stat
import time

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


class RootWalk:
    """The root of a cache with every link on its way followed, as ``os.path.realpath``
    finds it, and what the same walk found on the way (see ``resolve_root``)."""

    __slots__ = ("folders", "path", "problem")

    def __init__(
        self, path: str, problem: str | None, folders: list[tuple[str, os.stat_result | None]]
    ) -> None:
        self.path = path  # (as far as it was followed, when there is a problem)
        self.problem = problem  # why the root may not be used, or None
        self.folders = folders  # each folder of ``path`` from / down: its lstat, or None


def resolve_root(root: str | os.PathLike[str]) -> RootWalk:
    """Resolve ``root`` and judge each link on its way in one walk.

    Each step is ``lstat``ed as ``os.path.realpath`` does it (the same system
    calls: one per step, a ``readlink`` per link), and a link is followed only
    if it is this user's or root's: another user's link (``ln -s ~alice/project
    /tmp/x/kernel_cache`` by mallory, or a team member's in a team's folder)
    leads wherever its owner chose, into a folder of this user's that the
    trust rule would pass and maintenance would empty; the walk stops there and
    says so (``problem``).  What is not there (yet) is taken as named, as
    ``realpath`` takes it.
    """
    return _walk(os.fspath(root), None, None)


def open_root(root: str | os.PathLike[str], modes: Modes | None) -> tuple[int, str]:
    """A handle on the root (``O_RDONLY``, for listing and ``*at`` calls) and its path,
    reached one folder at a time from ``/``, each opened without following a link
    and each link met judged as ``resolve_root`` judges it, then followed by
    its own walk: what the handle holds is the folder this walk judged, whatever
    is swapped on the way meanwhile.  For where the root is opened to delete in.

    UntrustedFolder for another user's link, and, with ``modes`` of a
    group-shared cache, for what ``root_problem`` refuses (judged on the
    handles of the same walk); FileNotFoundError or NotADirectoryError when the
    root or a folder on its way is missing or no folder.
    """
    box = [os.open("/", _STEP)]
    try:
        walk = _walk(os.fspath(root), box, modes)
        if walk.problem is not None:
            raise UntrustedFolder(walk.problem)
        try:
            fd = os.open(".", _READ, dir_fd=box[0])  # (the steps' handles may be O_PATH)
        except OSError as e:
            raise OSError(e.errno, e.strerror, walk.path) from None
        _step_to(box, fd)
    except BaseException:
        os.close(box[0])
        raise
    return box[0], walk.path


# A step of open_root's walk: search permission is all a folder on the way needs.
_STEP = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_MAX_LINKS = 40  # (Linux's limit on the links one lookup follows)


def _walk(root: str, box: list[int] | None, modes: Modes | None) -> RootWalk:
    """``resolve_root``'s walk by ``lstat``, or with ``box`` (a handle on ``/``) by
    handles, ``box[0]`` the folder reached; with ``modes``, ``root_problem``'s
    group rule judged on them."""
    if not root.startswith("/"):
        root = os.path.join(os.getcwd(), root)  # (getcwd's path holds no link)
    todo = root.split("/")[::-1]  # the names still to walk, the next one last
    done = ""  # the folders walked ("" is /)
    folders: list[tuple[str, os.stat_result | None]] = []
    links = 0
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            if done:
                if box is not None:
                    _step_to(box, os.open("..", _STEP, dir_fd=box[0]))
                done = done.rpartition("/")[0]
                folders.pop()
            continue
        step = f"{done}/{name}"
        st: os.stat_result | None
        if box is None:
            try:
                st = os.lstat(step)
            except OSError:
                st = None  # (not there yet, or not to be looked at: taken as named)
        else:
            try:
                _step_to(box, os.open(name, _STEP, dir_fd=box[0]))
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(e.errno, e.strerror, step) from None
                st = os.stat(name, dir_fd=box[0], follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise OSError(e.errno, e.strerror, step) from None
            else:
                st = os.fstat(box[0]) if modes is not None and modes.group is not None else None
        if st is not None and stat.S_ISLNK(st.st_mode):
            rest = "/".join(reversed(todo))
            if st.st_uid not in (_UID, 0):
                where = f"{step}/{rest}" if rest else step
                return RootWalk(where, _foreign_link(step, st.st_uid, root), folders)
            links += 1
            if links > _MAX_LINKS:
                return RootWalk(root, f"{root}: {os.strerror(errno.ELOOP)}", folders)
            try:
                target = os.readlink(name, dir_fd=box[0]) if box is not None else os.readlink(step)
            except OSError:
                if box is not None:
                    raise
                done = step  # (gone since its lstat: taken as named)
                folders.append((step, None))
                continue
            if target.startswith("/"):
                done, folders = "", []
                if box is not None:
                    _step_to(box, os.open("/", _STEP))
            todo.extend(reversed(target.split("/")))
            continue
        done = step
        folders.append((step, st))
    walk = RootWalk(done or "/", None, folders)
    if modes is not None and modes.group is not None:
        walk.problem = _group_problem(walk, modes.group)
    return walk


def _step_to(box: list[int], fd: int) -> None:
    os.close(box[0])
    box[0] = fd


def _foreign_link(path: str, uid: int, root: str) -> str:
    way = "" if path == root.rstrip("/") else f" (on the way to {root})"
    return (
        f"{path}{way} is a link of another user's (uid {uid}), not yours or root's: "
        "not followed, since whoever made it chooses where it leads"
    )


def root_problem(root: str | os.PathLike[str], modes: Modes) -> str | None:
    """Why the root of a cache may not be used, or None.

    A link on its way that is another user's is never followed (``resolve_root``).
    A group-shared cache's root (judged where its links lead) may not be writable
    by others, and no folder above it may be setgid of the cache's group and
    writable by others, where anyone could have made the root or a folder on its
    way, with the group's id (a member's name is no proof: a pod of a Kubernetes
    ``fsGroup`` runs as any uid).  A private cache trusts no one else's folder
    below its root, whatever the root.  A root not made yet is judged by the
    folders above it.
    """
    return _walk(os.fspath(root), None, modes).problem


def _group_problem(walk: RootWalk, group: int) -> str | None:
    """``root_problem``'s rule of a group-shared root, on the folders ``walk`` went through."""
    if not walk.folders:
        return None
    path, st = walk.folders[-1]
    if st is not None and st.st_mode & stat.S_IWOTH:
        # (not made yet: made by us, 2770, in a folder judged below)
        return f"{path} is writable by others, so anyone could plant a kernel there"
    for path, st in reversed(walk.folders[:-1]):
        # (one not there: then the root cannot be reached either)
        mode = 0 if st is None or st.st_gid != group else st.st_mode
        if mode & stat.S_IWOTH and mode & stat.S_ISGID:
            return (
                f"{path} is setgid for the cache's group {group} and writable by others, "
                "so anyone could make a folder of the group's there and plant a kernel in it"
            )
    return None


def check_root(root: str | os.PathLike[str], modes: Modes) -> str:
    """Raise UntrustedFolder when ``root_problem`` finds one; else the root's resolved path."""
    walk = _walk(os.fspath(root), None, modes)
    if walk.problem is not None:
        raise UntrustedFolder(walk.problem)
    return walk.path


def private_group(uid: int, gid: int) -> bool:
    """Whether ``gid`` is the user private group of ``uid``: its primary group, of its
    name, with no other member, listed or by primary group.

    An answer is kept ``PRIVATE_GROUP_SECONDS``: a long-lived process (the server)
    asks again, and finds a member added to the group since."""
    now = _clock()
    known = _private.get((uid, gid))
    if known is not None and now - known[1] < PRIVATE_GROUP_SECONDS:
        return known[0]
    import grp
    import pwd

    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except (KeyError, OSError):
        private = False
    else:
        private = (
            user.pw_gid == gid
            and group.gr_name == user.pw_name
            and set(group.gr_mem) <= {user.pw_name}
            # (a group's members by their primary group are not in gr_mem)
            and not any(u.pw_gid == gid and u.pw_uid != uid for u in pwd.getpwall())
        )
    _private[uid, gid] = private, now
    return private


# How long an answer of private_group holds (getpwall reads the whole user directory,
# which may be LDAP's: not at every check).
PRIVATE_GROUP_SECONDS = 60.0
_private: dict[tuple[int, int], tuple[bool, float]] = {}
_clock = time.monotonic


def check(st: os.stat_result, modes: Modes, what: object) -> None:
    """Raise UntrustedFolder naming ``what`` when the trust rule fails."""
    reason = problem(st, modes)
    if reason is not None:
        raise UntrustedFolder(f"{what} is {reason}")
