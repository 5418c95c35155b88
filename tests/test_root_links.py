"""The way to a cache root: each link on it judged as the root is resolved.

Another user's link is never followed (``trust.resolve_root``, ``trust.open_root``);
this user's and root's are, to the folder ``os.path.realpath`` finds.
"""

from __future__ import annotations

import os
from pathlib import Path

from opcache import trust


def test_the_walk_resolves_as_realpath_does(tmp_path: Path) -> None:
    """This user's links, relative and absolute, chained, with ``..`` in them and after
    them, and a tail that is not there (yet): the path realpath gives, and a handle on
    that folder."""
    real = tmp_path / "disk" / "a" / "b"
    real.mkdir(parents=True)
    (tmp_path / "abs").symlink_to(tmp_path / "disk")
    (tmp_path / "disk" / "rel").symlink_to("a/b/..")
    (tmp_path / "chain").symlink_to("abs/rel")
    (tmp_path / "dotdot").symlink_to("disk/a/b/../../a")
    cases = [
        "abs/a/b",
        "chain",
        "chain/b",
        "chain/b/..",
        "dotdot/b",
        "abs/rel/../a/b",
        "abs/missing/x",
        "abs/missing/../a",
        "chain/b/./",
    ]
    for case in cases:
        path = f"{tmp_path}/{case}"
        walk = trust.resolve_root(path)
        assert (walk.path, walk.problem) == (os.path.realpath(path), None), case
        if "missing" not in case:  # (the kernel's lookup fails there too)
            fd, resolved = trust.open_root(path, None)
            try:
                assert resolved == walk.path
                assert os.path.samestat(os.fstat(fd), os.stat(walk.path))
            finally:
                os.close(fd)
    (tmp_path / "loop").symlink_to("loop")
    assert "Too many levels" in (trust.resolve_root(tmp_path / "loop").problem or "")
