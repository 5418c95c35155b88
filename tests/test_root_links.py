"""A cache root reached through another user's link is refused; one's own and root's work.

Every path may be a link another user planted: ``/tmp/x/kernel_cache`` made by
mallory to lead into alice's project, or a team's shared folder swapped by a
member for a link to alice's private folder.  The root's way was resolved with
``realpath`` and its target judged by its owner alone, which alice's own
folder passes: ``opcache clear`` then emptied her project, ``cann verify
--fix`` deleted its files as corrupt entries and orphans, and ``remote
clear`` took it for her private cache.  Here the links are made by other
users for real (children that drop root's privileges), and alice's commands
run as alice.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers_cache import SOC, toolkit_env
from helpers_faults import (
    CHILD_PROLOGUE,
    MEMBER_A,
    MEMBER_B,
    TEAM_GID,
    listing,
    open_folder,
    requires_root,
    run_as,
)

from opcache import trust
from opcache.cli import main
from opcache.storage.entry import make_manifest
from opcache.storage.local import LocalStore

ALICE = MEMBER_A  # the victim
MALLORY = MEMBER_B  # who plants a link (bob, in the team's case: a member)
KEY = "0123456789abcdef" * 2

# alice's commands, each one [status, stdout, stderr].
_CLI = (
    CHILD_PROLOGUE
    + """
import contextlib, io
from opcache.cli import main
os.environ.update({env!r})
said = []
for args in {commands!r}:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(args)
    said.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(said))
"""
)

# alice compiles one operator twice: the statuses, and the warnings said.
_COMPILE = (
    CHILD_PROLOGUE
    + """
settings = opcache.resolve_settings(
    op_compiler_cache_mode="enable", op_compiler_cache_dir={cache_dir!r},
    environ={{"HOME": {home!r}, **{env!r}}},
)
compiler = h.ToyCompiler({calls!r})
statuses = []
with opcache.OpCache(settings) as cache:
    for _ in range(2):
        statuses.append(cache.compile(h.make_request(0), compiler, Path({out!r})).status)
print(json.dumps({{"statuses": statuses, "warnings": keep.messages}}))
"""
)

# alice stores an entry in the shared folder.
_STORE = """
import json, os
from opcache.settings import RemoteSettings
from opcache.storage.entry import make_manifest
from opcache.storage.folder import connect
os.mkdir({share!r}, 0o2770)
os.chmod({share!r}, 0o2770)
key, files = {key!r}, {{"k.o": b"shared kernel"}}
r = connect(RemoteSettings("file://{share}", None, False, "opcache:1:", None, 64, 2.0))
print(json.dumps(r.put({soc!r}, key, make_manifest(key, files, 1.0, {{}}, 0.0), files)))
"""


def _as(uid: int, code: str, groups: tuple[int, ...] = ()) -> Any:
    return run_as(uid, uid, code, groups=groups)


def _plant_link(uid: int, target: Path, link: Path, groups: tuple[int, ...] = ()) -> None:
    """``link`` -> ``target``, made by ``uid`` (moving aside what was at ``link``)."""
    code = (
        "import json, os\n"
        f"if os.path.lexists({str(link)!r}):\n"
        f"    os.rename({str(link)!r}, {str(link) + '.old'!r})\n"
        f"os.symlink({str(target)!r}, {str(link)!r})\n"
        f"print(json.dumps(os.lstat({str(link)!r}).st_uid))\n"
    )
    assert _as(uid, code, groups) == uid


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    for dirpath, _dirs, files in os.walk(path):
        os.chown(dirpath, uid, gid)
        for name in files:
            os.chown(os.path.join(dirpath, name), uid, gid)


def _alices_project(base: Path) -> Path:
    """alice's folder (hers, 0755) and a project in it named as a cache root is: folders
    named as chips may be (src, docs, include), and files two hours old that CANN's
    verify would take for a corrupt entry (a json) and an orphan (a header)."""
    project = base / "alice" / "kernel_cache"
    old = time.time() - 7200
    files = {
        "src/main.c": "int main(void) { return 0; }\n",
        "src/settings.json": '{"name": "app", "debug": true}\n',
        "include/api.h": "int f(void);\n",
        "docs/README": "notes\n",
    }
    for name, text in files.items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.utime(path, (old, old))
    for folder in (base / "alice", *project.rglob("*"), project):
        if folder.is_dir():
            folder.chmod(0o755)
    _chown_tree(base / "alice", ALICE, ALICE)
    return project


def _sticky(base: Path) -> Path:
    """A folder anyone may make things in, as /tmp (1777)."""
    folder = base / "sticky"
    folder.mkdir()
    folder.chmod(0o1777)
    return folder


def _refused(said: list, commands: list[list[str]], link: Path) -> None:
    """Each command failed with one error line naming the link (exit 3: refused, for
    export)."""
    for args, (status, out, err) in zip(commands, said, strict=True):
        assert (status, out) == (3 if args[0] == "export" else 1, ""), (args, out, err)
        lines = err.splitlines()
        assert len(lines) == 1, (args, err)
        assert lines[0].startswith("opcache: error: "), (args, err)
        assert f"{link}" in lines[0] and "is a link of another user's" in lines[0], (args, err)


MAINTENANCE = (
    ["clear"],
    ["verify"],
    ["age"],
    ["stats"],
    ["cann", "verify", "--fix"],
    ["cann", "age"],
    ["cann", "stats"],
)


@requires_root
@pytest.mark.parametrize("where", ["root", "above"])
def test_maintenance_never_follows_another_users_link_on_the_roots_way(where: str) -> None:
    """mallory plants the cache root (or a folder above it) in a folder anyone may write,
    leading into alice's project: each of alice's commands there is refused with one
    line, and her project is as it was (before: ``clear`` said "cleared docs,
    include, src", ``cann verify --fix`` removed settings.json and api.h)."""
    with open_folder() as base:
        project = _alices_project(base)
        sticky = _sticky(base)
        if where == "root":
            cache_dir, link = sticky, sticky / "kernel_cache"
            _plant_link(MALLORY, project, link)
        else:
            link = cache_dir = sticky / "alices"
            _plant_link(MALLORY, project.parent, link)
        before = listing(project)
        archive = project.parent / "alices.tar"
        commands = [
            [*c, "--op_compiler_cache_dir", str(cache_dir)]
            for c in (*MAINTENANCE, ["export", str(archive)])
        ]
        env = {"HOME": str(project.parent)}
        said = _as(ALICE, _CLI.format(env=env, commands=commands))
        _refused(said, commands, link)
        assert listing(project) == before
        assert not archive.exists()


@requires_root
@pytest.mark.parametrize("where", ["root", "above"])
def test_a_compile_through_another_users_link_runs_uncached_with_one_warning(where: str) -> None:
    """The compile path refuses the same root: one warning, the compile runs without the
    cache, and nothing is written into alice's project, with a toolkit whose versions
    op_cache.ini would be made with (before: its entry was stored there, and a hit
    served from it; a root not there below the link was made there)."""
    with open_folder() as base:
        project = _alices_project(base)
        sticky = _sticky(base)
        if where == "root":
            link = sticky / "kernel_cache"
            _plant_link(MALLORY, project, link)
            cache_dir = sticky
        else:  # (the root would be src/kernel_cache: not there)
            link = cache_dir = sticky / "alices"
            _plant_link(MALLORY, project / "src", link)
        before = listing(project)
        calls, out = base / "calls", base / "out"
        calls.touch(mode=0o666)
        calls.chmod(0o666)
        out.mkdir()
        out.chmod(0o777)
        code = _COMPILE.format(
            cache_dir=str(cache_dir),
            home=str(project.parent),
            env=toolkit_env(base),
            calls=str(calls),
            out=str(out),
        )
        report = _as(ALICE, code)
        assert report["statuses"] == ["miss", "miss"]
        (warning,) = report["warnings"]
        assert f"{link}" in warning and "is a link of another user's" in warning, warning
        assert listing(project) == before


@requires_root
def test_a_team_members_link_in_place_of_the_shared_folder_is_refused() -> None:
    """A team's shared folder remote in a folder the team writes: bob, a member, swaps it
    for a link to alice's project.  Its target's modes (alice's, 0755) made it alice's
    private cache, and ``remote clear`` emptied her project; now both of alice's
    ``remote`` commands are refused with one line."""
    with open_folder() as base:
        project = _alices_project(base)
        team = base / "team"
        team.mkdir()
        os.chown(team, 0, TEAM_GID)
        team.chmod(0o2770)
        share = team / "share"
        code = _STORE.format(share=str(share), key=KEY, soc=SOC)
        assert _as(ALICE, code, groups=(TEAM_GID,)) > 0
        _plant_link(MALLORY, project, share, groups=(TEAM_GID,))
        before = listing(project)
        commands = [["remote", "clear"], ["remote", "stats"]]
        env = {"HOME": str(project.parent), "OPCACHE_REMOTE": f"file://{share}"}
        said = _as(ALICE, _CLI.format(env=env, commands=commands), groups=(TEAM_GID,))
        _refused(said, commands, share)
        assert listing(project) == before
        assert (team / "share.old" / SOC).is_dir()  # (the team's entries: not touched)


@requires_root
def test_a_link_put_in_the_roots_place_after_it_was_resolved_is_not_followed_to_delete() -> None:
    """The root is resolved once per process; a member of a team that writes the folder
    the root is in swaps it for a link afterwards.  Clearing, discarding and cleaning
    reach the root again one folder at a time, each link judged as it is met: nothing
    of the folder the link names is deleted (before: the chip folder of that name was
    renamed into a trash made there, and deleted)."""
    with open_folder() as base:
        team = base / "team"
        team.mkdir()
        team.chmod(0o777)  # (anyone may rename in it: no sticky bit)
        victim = base / "victim"  # root's, holding a folder named as the chip
        (victim / SOC).mkdir(parents=True)
        (victim / SOC / "keep.txt").write_text("mine\n")
        store = LocalStore(team / "share")
        files = {"k.o": b"kernel"}
        assert store.put(SOC, KEY, make_manifest(KEY, files, 1.0, {}, 0.0), files, now=1.0)
        before = listing(victim)
        _plant_link(MALLORY, victim, team / "share")
        with pytest.raises(trust.UntrustedFolder, match="is a link of another user's"):
            store.clear_chip(SOC)
        with pytest.raises(trust.UntrustedFolder, match="is a link of another user's"):
            store.discard(SOC, KEY)
        assert store.clean_leftovers() == 0
        assert listing(victim) == before
        assert (team / "share.old" / SOC).is_dir()


_OWN_LINK = """
import json, os
os.mkdir({big!r}, 0o755)
os.symlink({big!r}, {link!r})
print(json.dumps(True))
"""


@requires_root
def test_links_of_ones_own_and_of_roots_are_followed() -> None:
    """alice's cache root as her own link to a bigger disk, and root's link (/data ->
    /mnt/...), the second one in a folder alice may search but not list (mode 0711):
    each is used as before, compiles hit and maintenance works."""
    with open_folder() as base:
        alice = base / "alice"
        alice.mkdir()
        os.chown(alice, ALICE, ALICE)
        assert _as(ALICE, _OWN_LINK.format(big=str(alice / "big"), link=str(alice / "ops")))
        search_only = base / "mnt"
        search_only.mkdir()
        search_only.chmod(0o711)
        (search_only / "disk").mkdir()
        os.chown(search_only / "disk", ALICE, ALICE)
        (base / "data").symlink_to(search_only / "disk")  # root's
        calls, out = base / "calls", base / "out"
        calls.touch(mode=0o666)
        calls.chmod(0o666)
        out.mkdir()
        out.chmod(0o777)
        for cache_dir, target in ((alice / "ops", alice / "big"), (base / "data", search_only)):
            code = _COMPILE.format(
                cache_dir=str(cache_dir), home=str(alice), env={}, calls=str(calls), out=str(out)
            )
            report = _as(ALICE, code)
            assert report == {"statuses": ["miss", "hit"], "warnings": []}, cache_dir
            commands = [
                [*c, "--op_compiler_cache_dir", str(cache_dir)]
                for c in (["stats"], ["verify"], ["clear"])
            ]
            said = _as(ALICE, _CLI.format(env={"HOME": str(alice)}, commands=commands))
            assert [status for status, _, _ in said] == [0, 0, 0], said
            assert said[2][1] == f"cleared {SOC}\n"
            if target == alice / "big":
                assert (target / "kernel_cache" / ".opcache").is_dir()
            else:
                assert (target / "disk" / "kernel_cache" / ".opcache").is_dir()


# -- without other users ---------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_clear_deletes_only_in_a_folder_that_holds_a_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder named by mistake (a project, a home) holds folders named as chips may be,
    but no ``.opcache``, which every cache opcache stored in holds: ``clear`` and
    ``remote clear`` delete nothing there and say why (before: "cleared docs, src")."""
    root = tmp_path / "ops" / "kernel_cache"
    for name in ("src", "docs"):
        (root / name).mkdir(parents=True)
        (root / name / "mine.txt").write_text("mine\n")
    before = listing(root)
    status, out, err = _run(capsys, "clear", "--op_compiler_cache_dir", str(tmp_path / "ops"))
    assert (status, out) == (1, "")
    assert err == (
        f"opcache: error: no cache in {root}: it holds no .opcache folder, as every cache "
        "opcache has stored in does, so nothing in it is cleared\n"
    )
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OPCACHE_REMOTE", f"file://{root}")
    status, out, err = _run(capsys, "remote", "clear")
    assert (status, out) == (1, "")
    assert err.startswith(f"opcache: error: file://{root}: no cache in {root}: "), err
    assert listing(root) == before


def test_a_root_with_only_folders_named_as_no_chip_holds_no_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ops" / "kernel_cache"
    (root / "lost+found").mkdir(parents=True)
    (root / "notes by alice").mkdir()
    for command in ("stats", "clear"):
        status, out, err = _run(capsys, command, "--op_compiler_cache_dir", str(tmp_path / "ops"))
        assert (status, out) == (1, "")
        assert err.startswith(f"opcache: error: no cache in {root} (from "), err


def test_cann_leaves_folders_named_as_no_chip_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lost+found`` of a CANN root on its own file system is no chip folder: ``cann
    verify --fix`` removed what it held as orphans."""
    from helpers_cann import kernel_name, store_entry, write_ini

    root = tmp_path / "atc" / "kernel_cache"
    write_ini(root)
    store_entry(root / SOC, kernel_name("Add", "k"), b"kernel")
    lost = root / "lost+found" / "te_add_0.o"
    lost.parent.mkdir()
    lost.write_bytes(b"found after fsck")
    os.utime(lost, (time.time() - 7200, time.time() - 7200))
    status, out, err = _run(
        capsys, "cann", "verify", "--fix", "--json", "--op_compiler_cache_dir", str(root.parent)
    )
    assert (status, err) == (0, "")
    assert list(json.loads(out)["chips"]) == [SOC]
    assert lost.read_bytes() == b"found after fsck"


# -- the walk itself ---------------------------------------------------------------------


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
