"""The links a traced compile makes itself, followed as its calls are taken in time order.

``readset``'s, on a miss only (a hit does not load it): a path the compile
reached through a symlink or a hard link it had made is the path the link led
to (``Links.resolve``), so the file a staged ``kernel_meta/k.cpp`` stood for is
in the read set.
"""

from __future__ import annotations

import os


class LinkUnknown(Exception):
    """Where a link the compile made led cannot be known (``readset``: unprovable)."""


class Link:
    """A link the compile made: a symlink (``target``: its text), a hard link
    (``source``: the path of the file it links, as the compile named it then), or a
    hard link to a file with no name to check (``unknown``: why)."""

    __slots__ = ("end", "follow", "name", "source", "start", "target", "unknown")

    def __init__(
        self,
        name: str,
        start: int,
        *,
        target: str | None = None,
        source: str | None = None,
        follow: bool = False,
        unknown: str = "",
    ) -> None:
        self.name, self.start, self.end = name, start, None  # (when made, removed: µs)
        self.target, self.source, self.follow, self.unknown = target, source, follow, unknown


class Links:
    """The links the compile has made so far, as its calls are taken in time order.

    A path is resolved as the kernel resolves it, but for the links the compile
    did not make (they stay in the path, and a hit's ``lstat`` follows them).
    """

    def __init__(self) -> None:
        self.live: dict[str, Link] = {}  # by name
        self.bases: dict[str, int] = {}  # the live links' last parts (how many of each)
        self.hard: dict[str, list[Link]] = {}  # every hard link made, by its source
        self.moved_from: dict[str, Link] = {}  # links renamed away, by their old name
        self._real: dict[str, str] = {}

    def add(self, link: Link) -> None:
        self.moved_from.pop(link.name, None)
        if self.live.get(link.name) is None:
            base = os.path.basename(link.name)
            self.bases[base] = self.bases.get(base, 0) + 1
        self.live[link.name] = link
        if link.source is not None:
            self.hard.setdefault(link.source, []).append(link)

    def remove(self, path: str, when: int) -> None:
        link = self.at(path)
        if link is None:
            # (a name a link was moved from, still there: a rename onto another name of
            # the same file does nothing, so `ln -f` then removes its temporary name)
            link = self.moved_from.pop(path, None)
            if link is not None:
                link.end = max(link.end or when, when)
            return
        del self.live[link.name]
        base = os.path.basename(link.name)
        self.bases[base] -= 1
        if not self.bases[base]:
            del self.bases[base]
        link.end = when

    def renamed(self, old: str, new: str, when: int, exchange: bool) -> None:
        """A rename: the links the compile made at ``old`` or under it move to ``new``
        (a symlink keeps its text, a hard link its file), one at ``new`` is replaced
        (``ln -sf`` makes the link under a temporary name, then renames it)."""
        if old == new:
            return
        exact = self.at(old)
        moving = [exact] if exact is not None else []
        moving += [link for name, link in self.live.items() if name.startswith(old + "/")]
        if exchange:
            if moving or self.at(new) or any(n.startswith(new + "/") for n in self.live):
                raise LinkUnknown(f"{old}: a link the compile made was swapped with {new}")
            return
        replaced = self.at(new)
        if replaced is not None:
            self.remove(replaced.name, when)
        for link in moving:
            self.remove(link.name, when)
            name = new + link.name[len(exact.name if link is exact else old) :]
            self.moved_from[link.name] = link
            self.add(
                Link(
                    name,
                    when,
                    target=link.target,
                    source=link.source,
                    follow=link.follow,
                    unknown=link.unknown,
                )
            )

    def at(self, path: str) -> Link | None:
        """The link made at ``path`` (or at the same name in its real folder)."""
        link = self.live.get(path)
        base = os.path.basename(path)
        if link is not None or base not in self.bases:
            return link
        real = self._realpath(os.path.dirname(path))
        for name, link in self.live.items():
            if os.path.basename(name) == base and self._realpath(os.path.dirname(name)) == real:
                return link
        return None

    def _realpath(self, folder: str) -> str:
        if folder not in self._real:
            self._real[folder] = os.path.realpath(folder)
        return self._real[folder]

    def resolve(self, path: str, final: str) -> tuple[str, str]:
        """``path`` through the links the compile made (``final``: as ``readset._finals``), and
        how: ``""`` (through none), ``symlink``, ``hard`` (its last part is a hard link:
        the file it links), ``blind`` (a hard link to a file with no name: the link's
        name is given)."""
        if not self.live or not path.startswith("/"):
            return os.path.normpath(path), ""
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if self.bases.keys().isdisjoint(parts):  # (no name on the way is one's)
            return os.path.normpath(path), ""
        todo = parts[::-1]
        done, hops, kind = "/", 0, ""
        while todo:
            part = todo.pop()
            if part == "..":
                if hops:
                    # Past a link, the kernel's parent of the folder it reached: through
                    # a link of the user's on the way, a file a hit would not look for
                    # again through that link (re-pointed, it leads elsewhere).
                    real = os.path.realpath(done)
                    if real != os.path.normpath(done):
                        raise LinkUnknown(f"{path}: .. past a link the compile made, then a link")
                    done = real
                done = os.path.dirname(done)
                continue
            here = os.path.join(done, part)
            last = not todo
            link = None if last and final == "name" else self.at(here)
            if link is None or (last and final == "nofollow" and link.target is not None):
                done = here
                continue
            hops += 1
            if hops > 40:  # (the kernel's own limit: ELOOP)
                raise LinkUnknown(f"{path}: too many links the compile made on the way")
            if link.unknown:
                return os.path.normpath(os.path.join(here, *reversed(todo))), "blind"
            if link.source is not None:
                done, kind = link.source, "hard" if last else kind
                continue
            kind = "symlink"
            if link.target is not None and link.target.startswith("/"):
                done = "/"
            todo.extend(p for p in reversed((link.target or "").split("/")) if p not in ("", "."))
        return os.path.normpath(done), kind
