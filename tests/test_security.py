"""Shared and hostile caches: the trust rule, group-shared mode, links (issue 5).

A cache folder others can write to is a place where someone can plant a kernel.
Most tests here plant one: they turn a stored entry into a *valid* entry
(manifest and checksums right) with other bytes, then make some folder or file
on its way untrusted.  Only the trust rule stands between that kernel and a
hit, so a "hit", or the planted bytes in ``out_dir``, is the failure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_cache import (
    SOC,
    ToyCompiler,
    entry_dirs,
    expected_files,
    make_request,
    read_dir,
    run_script,
    toolkit_env,
    trash_emptied,
    tree_bytes,
)
from helpers_faults import (
    CHILD_PROLOGUE,
    IS_ROOT,
    MEMBER_A,
    MEMBER_B,
    NOBODY,
    TEAM_GID,
    copy_as,
    evil,
    file_mode,
    listing,
    open_folder,
    plant,
    requires_root,
    run_as,
    settings_for,
    team_cache,
    warnings_of,
)

import opcache
from opcache import fsutil, trust
from opcache.storage.entry import MANIFEST


@pytest.fixture
def compiler(tmp_path: Path) -> ToyCompiler:
    return ToyCompiler(tmp_path / "calls", size=4096)


def store_and_plant(tmp_path: Path, compiler: ToyCompiler, **options) -> tuple[str, Path]:
    """Store request 0, then replace its entry by a valid one with planted bytes."""
    with opcache.OpCache(settings_for(tmp_path, **options)) as cache:
        result = cache.compile(make_request(), compiler, tmp_path / "first")
    assert result.status == "miss"
    entry = entry_dirs(settings_for(tmp_path).root)[result.key]
    plant(entry, evil(expected_files(make_request(), compiler.size)))
    return result.key, entry


def target_of(level: str, entry: Path) -> Path:
    """The part of the way to an entry that a test makes untrusted."""
    if level == "chip":
        return entry.parent.parent
    if level == "bucket":
        return entry.parent
    if level == "entry":
        return entry
    if level == "manifest":
        return entry / MANIFEST
    return next(p for p in entry.iterdir() if p.suffix == ".o")


def compile_again(tmp_path: Path, compiler: ToyCompiler, caplog, **options) -> tuple:
    """Two compiles of request 0 in one OpCache; (results, warnings, stats)."""
    caplog.clear()
    caplog.set_level(logging.WARNING)
    with opcache.OpCache(settings_for(tmp_path, **options)) as cache:
        first = cache.compile(make_request(), compiler, tmp_path / "out")
        second = cache.compile(make_request(), compiler, tmp_path / "out2")
        stats = cache.stats()
    return (first, second), warnings_of(caplog), stats


def assert_not_served(tmp_path: Path, compiler: ToyCompiler, results, calls_before: int) -> None:
    """Compiled again, right bytes delivered, the planted kernel never."""
    good = expected_files(make_request(), compiler.size)
    for result, out in zip(results, ("out", "out2"), strict=True):
        assert result.status == "miss"
        assert read_dir(tmp_path / out) == good
    assert compiler.calls() == calls_before + len(results)


# ------------------------------------------------------------ the trust rule


LEVELS = ["chip", "bucket", "entry", "manifest", "artifact"]


@pytest.mark.parametrize("level", LEVELS)
def test_writable_by_others_is_never_read(
    tmp_path: Path, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture, level: str
) -> None:
    _key, entry = store_and_plant(tmp_path, compiler)
    target = target_of(level, entry)
    os.chmod(target, file_mode(target) | stat.S_IWOTH)
    results, warnings, stats = compile_again(tmp_path, compiler, caplog)
    assert_not_served(tmp_path, compiler, results, calls_before=1)
    # One warning for the OpCache, naming what is wrong and why.
    assert len(warnings) == 1, warnings
    named = target.name if level in ("manifest", "artifact") else str(target)
    assert named in warnings[0]
    assert "writable by others" in warnings[0]
    # One error per compile that met the untrusted folder; nothing stored.
    assert stats["errors"] == 2
    assert stats["stores"] == 1  # the first compile's, before the folder went bad
    assert stats["hits"] == 0


@pytest.mark.parametrize("level", ["chip", "bucket", "entry", "artifact"])
def test_group_writable_is_untrusted_in_a_private_cache(
    tmp_path: Path, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture, level: str
) -> None:
    _key, entry = store_and_plant(tmp_path, compiler)
    target = target_of(level, entry)
    os.chmod(target, file_mode(target) | stat.S_IWGRP)  # (its owner's own group too)
    results, warnings, _stats = compile_again(tmp_path, compiler, caplog)
    assert_not_served(tmp_path, compiler, results, calls_before=1)
    assert len(warnings) == 1, warnings
    assert "writable by its group" in warnings[0]
    assert "OPCACHE_SHARED_GROUP" in warnings[0]  # says how to share it on purpose


def test_writable_by_its_owner_s_own_group_is_trusted(tmp_path: Path) -> None:
    """Where each user has a group of its own (Debian, Ubuntu, Fedora), the umask is
    002: an op_cache.ini a person writes is 0664, and its size keys were ignored, with
    a warning, as 'writable by its group'."""
    me = os.geteuid()
    mine = pwd.getpwuid(me).pw_gid
    if not trust.private_group(me, mine):
        pytest.skip("this user's group is not a group of its own here")
    ini = tmp_path / "cache" / "op_cache.ini"
    ini.parent.mkdir()
    ini.write_text("[op_compiler_cache]\nmax_op_cache_size=7\nremain_cache_size_ratio=30\n")
    os.chown(ini, me, mine)
    ini.chmod(0o664)
    settings = opcache.resolve_settings(
        op_compiler_cache_dir=str(tmp_path / "cache"), environ={"HOME": str(tmp_path)}
    )
    assert (settings.max_op_cache_size_mb, settings.remain_cache_size_ratio) == (7, 30)
    os.chown(ini, me, OTHER_GROUP)  # (a group of others: still refused)
    settings = opcache.resolve_settings(
        op_compiler_cache_dir=str(tmp_path / "cache"), environ={"HOME": str(tmp_path)}
    )
    assert settings.max_op_cache_size_mb == 500


def make_group_writable(root: Path) -> None:
    """chmod g+w everything below the root, as a group-shared cache is."""
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(dirpath) / name
            os.chmod(path, file_mode(path) | stat.S_IWGRP)


def test_group_writable_of_the_cache_group_is_trusted_in_group_shared_mode(
    tmp_path: Path, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture
) -> None:
    gid = os.getegid()
    with opcache.OpCache(settings_for(tmp_path, shared_group=gid)) as cache:
        stored = cache.compile(make_request(), compiler, tmp_path / "a")
    root = settings_for(tmp_path).root
    make_group_writable(root)
    caplog.set_level(logging.WARNING)
    # Through the argument and through the environment variable.
    for n, settings in enumerate(
        [
            settings_for(tmp_path, shared_group=gid),
            settings_for(tmp_path, env={"OPCACHE_SHARED_GROUP": str(gid)}),
        ]
    ):
        assert settings.shared_group == gid
        with opcache.OpCache(settings) as cache:
            result = cache.compile(make_request(), compiler, tmp_path / f"hit{n}")
        assert result.status == "hit"
        assert result.key == stored.key
        assert read_dir(tmp_path / f"hit{n}") == expected_files(make_request(), compiler.size)
    assert compiler.calls() == 1
    assert warnings_of(caplog) == []


def another_gid() -> int:
    """A group other than ours that this process may give files to."""
    if IS_ROOT:
        return NOBODY
    mine = os.getegid()
    for gid in os.getgroups():
        if gid != mine:
            return gid
    pytest.skip("needs root or a second group: chown to a foreign group is not permitted")


@pytest.mark.parametrize("level", ["chip", "entry", "artifact"])
def test_group_writable_of_another_group_is_untrusted_in_group_shared_mode(
    tmp_path: Path, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture, level: str
) -> None:
    gid = os.getegid()
    other = another_gid()
    _key, entry = store_and_plant(tmp_path, compiler, shared_group=gid)
    make_group_writable(settings_for(tmp_path).root)
    target = target_of(level, entry)
    os.chown(target, -1, other)
    os.chmod(target, file_mode(target) | stat.S_IWGRP)  # chown may drop setgid
    results, warnings, _stats = compile_again(tmp_path, compiler, caplog, shared_group=gid)
    assert_not_served(tmp_path, compiler, results, calls_before=1)
    assert len(warnings) == 1, warnings
    assert f"writable by group {other}, not the cache's group {gid}" in warnings[0]


@requires_root
@pytest.mark.parametrize("level", LEVELS)
def test_owned_by_another_user_is_never_read(
    tmp_path: Path, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture, level: str
) -> None:
    _key, entry = store_and_plant(tmp_path, compiler)
    target = target_of(level, entry)
    os.chown(target, NOBODY, NOBODY)  # the mode stays 0750 / 0640: only the owner is wrong
    results, warnings, _stats = compile_again(tmp_path, compiler, caplog)
    assert_not_served(tmp_path, compiler, results, calls_before=1)
    assert len(warnings) == 1, warnings
    assert f"owned by uid {NOBODY}" in warnings[0]


@requires_root
def test_another_member_of_the_cache_group_is_trusted_in_group_shared_mode(
    tmp_path: Path, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture
) -> None:
    # In a team's cache, entries belong to whichever member stored them.
    gid = os.getegid()
    with opcache.OpCache(settings_for(tmp_path, shared_group=gid)) as cache:
        stored = cache.compile(make_request(), compiler, tmp_path / "a")
    entry = entry_dirs(settings_for(tmp_path).root)[stored.key]
    for path in [entry, *entry.iterdir()]:
        os.chown(path, NOBODY, gid)
    caplog.set_level(logging.WARNING)
    with opcache.OpCache(settings_for(tmp_path, shared_group=gid)) as cache:
        shared = cache.compile(make_request(), compiler, tmp_path / "b")
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        private = cache.compile(make_request(), compiler, tmp_path / "c")
    assert shared.status == "hit"
    assert read_dir(tmp_path / "b") == expected_files(make_request(), compiler.size)
    # The same cache read as a private one is refused (group-writable, another owner).
    assert private.status == "miss"
    assert len(warnings_of(caplog)) == 1, warnings_of(caplog)
    assert read_dir(tmp_path / "c") == expected_files(make_request(), compiler.size)


def test_untrusted_build_folder_stores_nothing(
    tmp_path: Path, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture
) -> None:
    # Someone able to write into .opcache/tmp could swap an entry between build and publish.
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "a")
    tmp_dir = settings_for(tmp_path).root / ".opcache" / "tmp"
    os.chmod(tmp_dir, 0o777)
    caplog.set_level(logging.WARNING)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        hit = cache.compile(make_request(0), compiler, tmp_path / "b")
        miss = cache.compile(make_request(1), compiler, tmp_path / "c")
        stats = cache.stats()
    assert hit.status == "hit"  # the entry itself is trusted
    assert miss.status == "miss"
    assert read_dir(tmp_path / "c") == expected_files(make_request(1), compiler.size)
    assert len(entry_dirs(settings_for(tmp_path).root)) == 1
    assert os.listdir(tmp_dir) == []
    warnings = warnings_of(caplog)
    assert len(warnings) == 1, warnings
    assert str(tmp_dir) in warnings[0]
    assert "writable by others" in warnings[0]
    assert (stats["errors"], stats["stores"]) == (1, 1)


# ------------------------------------------------------------ trust.problem


def fake_stat(mode: int, uid: int, gid: int) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, gid, 0, 0, 0, 0))


ME = os.geteuid()
OTHER_UID = 4242 if ME != 4242 else 4243
GROUP = 777
OTHER_GROUP = 778
PRIVATE = fsutil.PRIVATE
SHARED = fsutil.group_shared(GROUP)
DIR = stat.S_IFDIR
REG = stat.S_IFREG


@pytest.mark.parametrize(
    ("mode", "uid", "gid", "modes", "problem"),
    [
        # Owned by me or root, not writable by others: trusted.
        (DIR | 0o750, ME, 0, PRIVATE, None),
        (DIR | 0o755, 0, 0, PRIVATE, None),
        (REG | 0o640, ME, OTHER_GROUP, PRIVATE, None),
        (REG | 0o444, 0, OTHER_GROUP, PRIVATE, None),
        # Another owner.
        (DIR | 0o700, OTHER_UID, 0, PRIVATE, f"owned by uid {OTHER_UID}, not by you or root"),
        (REG | 0o600, OTHER_UID, GROUP, PRIVATE, f"owned by uid {OTHER_UID}"),
        (REG | 0o640, OTHER_UID, OTHER_GROUP, SHARED, f"owned by uid {OTHER_UID}"),
        # Writable by others, whoever owns it, and in any mode; /tmp's 1777 too.
        (DIR | 0o757, ME, 0, PRIVATE, "writable by others"),
        (REG | 0o602, 0, 0, PRIVATE, "writable by others"),
        (DIR | 0o1777, 0, 0, PRIVATE, "writable by others"),
        (DIR | 0o2777, ME, GROUP, SHARED, "writable by others"),
        (REG | 0o666, OTHER_UID, GROUP, SHARED, "writable by others"),
        # Writable by the group: only in a group-shared cache, and only its group.
        (DIR | 0o770, ME, GROUP, PRIVATE, "writable by its group"),
        (REG | 0o660, 0, OTHER_GROUP, PRIVATE, "OPCACHE_SHARED_GROUP"),
        (DIR | 0o2770, ME, GROUP, SHARED, None),
        (REG | 0o660, ME, GROUP, SHARED, None),
        (DIR | 0o2770, ME, OTHER_GROUP, SHARED, f"writable by group {OTHER_GROUP}"),
        (REG | 0o660, 0, OTHER_GROUP, SHARED, f"not the cache's group {GROUP}"),
        # Another member of the cache's group may own things in a group-shared cache.
        (DIR | 0o2770, OTHER_UID, GROUP, SHARED, None),
        (REG | 0o640, OTHER_UID, GROUP, SHARED, None),
        # Not group-writable: the group does not matter.
        (DIR | 0o750, ME, OTHER_GROUP, SHARED, None),
    ],
)
def test_trust_problem(mode: int, uid: int, gid: int, modes: fsutil.Modes, problem) -> None:
    found = trust.problem(fake_stat(mode, uid, gid), modes)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


@pytest.mark.parametrize(
    ("parent_mode", "root_mode", "problem"),
    [
        (0o1777, 0o2770, None),  # a team's root in /tmp: 1777, not setgid
        (0o2770, 0o2770, None),  # in a team folder only members write
        (0o2777, None, "is setgid for the cache's group"),  # anyone could make the root
        (0o3777, 0o2770, "is setgid for the cache's group"),  # ... or have made it
        (0o755, 0o2777, "is writable by others, so anyone could plant a kernel there"),
        (0o755, 0o3777, "is writable by others, so anyone could plant a kernel there"),
    ],
)
def test_a_team_root_anyone_could_have_made_or_written_is_refused(
    tmp_path: Path, parent_mode: int, root_mode: int | None, problem: str | None
) -> None:
    gid = os.getegid()  # (a group of ours: no root needed to give it)
    shared, private = fsutil.group_shared(gid), fsutil.PRIVATE
    parent = tmp_path / "parent"
    parent.mkdir()
    os.chmod(parent, parent_mode)
    root = parent / "kernel_cache"
    if root_mode is not None:
        root.mkdir()
        os.chmod(root, root_mode)
    (tmp_path / "link").symlink_to(root)
    for path in (root, tmp_path / "link"):  # (a link is judged where it leads)
        found = trust.root_problem(path, shared)
        assert found == problem or (problem is not None and problem in str(found)), found
    assert trust.root_problem(root, private) is None  # (no one else's is trusted in it)
    os.chmod(parent, 0o755)  # (tmp_path's clean-up)


def test_trust_check_raises_an_oserror_naming_the_thing() -> None:
    trust.check(fake_stat(DIR | 0o750, ME, 0), PRIVATE, "/cache/x")  # no exception
    with pytest.raises(trust.UntrustedFolder, match=r"^/cache/x is writable by others$") as info:
        trust.check(fake_stat(DIR | 0o777, ME, 0), PRIVATE, "/cache/x")
    # An OSError: every path that survives an unwritable cache survives this one.
    assert isinstance(info.value, OSError)


# --------------------------------------------------------- group-shared modes


def _group_shared_tree(tmp_path: Path, umask: int) -> dict:
    """Use a group-shared cache in a fresh process under ``umask``; every path's mode and gid."""
    gid = os.getegid()
    ops, home = str(tmp_path / "ops"), str(tmp_path)
    toolkit = toolkit_env(tmp_path)  # (so that op_cache.ini is made)
    code = f"""
import json, os, stat, helpers_cache as h, opcache
settings = h.make_settings({ops!r}, {home!r}, env={toolkit!r}, shared_group={gid})
comp = h.ToyCompiler({str(tmp_path / "calls")!r})
with opcache.OpCache(settings) as c:
    for i in (0, 1, 0):
        c.compile(h.make_request(i), comp, {str(tmp_path / "out")!r})
    c.compile(h.make_request(0, soc_version="Ascend310P3"), comp, {str(tmp_path / "out")!r})
    c.verify()
    c.clear("Ascend310P3")
    c.age()
found = {{}}
root = {str(tmp_path / "ops")!r}
for dirpath, dirs, files in os.walk(root):
    for name in [*dirs, *files]:
        p = os.path.join(dirpath, name)
        st = os.lstat(p)
        mode = stat.S_IMODE(st.st_mode)
        found[os.path.relpath(p, root)] = [mode, st.st_gid, stat.S_ISDIR(st.st_mode)]
print(json.dumps(found))
"""
    done = run_script(code, umask=umask)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


UMASKS = [0o022, 0o077]
UMASK_IDS = ["umask022", "umask077"]


@pytest.mark.parametrize("umask", UMASKS, ids=UMASK_IDS)
def test_group_shared_folders_are_2770_of_the_group(tmp_path: Path, umask: int) -> None:
    tree = _group_shared_tree(tmp_path, umask)
    folders = {rel: (oct(mode), gid) for rel, (mode, gid, is_dir) in tree.items() if is_dir}
    # kernel_cache/<soc>/<bucket>/<key>: entry folders were seen
    assert any(len(Path(rel).parts) == 4 and rel.startswith("kernel_cache/A") for rel in folders)
    wrong = {rel: v for rel, v in folders.items() if v != (oct(0o2770), os.getegid())}
    assert wrong == {}


@pytest.mark.parametrize("umask", UMASKS, ids=UMASK_IDS)
def test_group_shared_files_are_0660_of_the_group(tmp_path: Path, umask: int) -> None:
    tree = _group_shared_tree(tmp_path, umask)
    files = {
        rel: (oct(mode), gid)
        for rel, (mode, gid, is_dir) in tree.items()
        if not is_dir and not rel.endswith("op_cache.ini")
    }
    assert any(rel.endswith(MANIFEST) for rel in files)
    assert any(rel.endswith(".lock") for rel in files)
    wrong = {rel: v for rel, v in files.items() if v != (oct(0o660), os.getegid())}
    assert wrong == {}


@pytest.mark.parametrize("umask", UMASKS, ids=UMASK_IDS)
def test_group_shared_cache_still_creates_op_cache_ini(tmp_path: Path, umask: int) -> None:
    tree = _group_shared_tree(tmp_path, umask)
    mode, gid, is_dir = tree[os.path.join("kernel_cache", "op_cache.ini")]
    assert not is_dir
    assert gid == os.getegid()  # joined the group through the setgid root folder
    assert mode & 0o040, oct(mode)  # the group can read the size limits
    assert not mode & 0o002


# ------------------------------------------------------------------- links


@pytest.mark.parametrize("which", ["cache_dir", "root"])
def test_the_root_may_be_a_link(tmp_path: Path, compiler: ToyCompiler, which: str) -> None:
    real = tmp_path / "real"
    real.mkdir()
    if which == "cache_dir":
        os.symlink(real, tmp_path / "ops")
        where = real / "kernel_cache"
    else:
        (tmp_path / "ops").mkdir()
        os.symlink(real, tmp_path / "ops" / "kernel_cache")
        where = real
    settings = settings_for(tmp_path, env=toolkit_env(tmp_path))
    with opcache.OpCache(settings) as cache:
        first = cache.compile(make_request(), compiler, tmp_path / "a")
        second = cache.compile(make_request(), compiler, tmp_path / "b")
        stats = cache.stats()
    assert (first.status, second.status) == ("miss", "hit")
    assert read_dir(tmp_path / "b") == expected_files(make_request(), compiler.size)
    assert set(entry_dirs(where)) == {first.key}
    assert (where / "op_cache.ini").is_file()
    assert stats["errors"] == 0


def test_a_linked_chip_folder_is_not_followed(
    tmp_path: Path, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = settings_for(tmp_path).root
    root.mkdir(parents=True)
    os.symlink(outside, root / SOC)
    results, warnings, stats = compile_again(tmp_path, compiler, caplog)
    assert_not_served(tmp_path, compiler, results, calls_before=0)
    assert listing(outside) == {}  # nothing written through the link
    assert len(warnings) == 1, warnings
    assert f"{root / SOC} is a link" in warnings[0]
    assert stats["stores"] == 0
    assert stats["errors"] == 2


def test_a_linked_bucket_is_not_followed(
    tmp_path: Path, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture
) -> None:
    _key, entry = store_and_plant(tmp_path, compiler)
    bucket = entry.parent
    outside = tmp_path / "outside"
    shutil.move(bucket, outside)  # the planted entry, complete and valid, behind a link
    os.symlink(outside, bucket)
    before = listing(outside)
    results, warnings, stats = compile_again(tmp_path, compiler, caplog)
    assert_not_served(tmp_path, compiler, results, calls_before=1)
    assert listing(outside) == before
    assert len(warnings) == 1, warnings
    assert f"{bucket} is a link" in warnings[0]
    assert stats["stores"] == 1  # the first compile's
    assert stats["errors"] == 2


@pytest.mark.parametrize("level", ["chip", "bucket"])
def test_maintenance_never_writes_through_a_link(
    tmp_path: Path, compiler: ToyCompiler, level: str
) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        key = cache.compile(make_request(), compiler, tmp_path / "a").key
    root = settings_for(tmp_path).root
    outside = tmp_path / "outside"
    link = root / SOC if level == "chip" else root / SOC / key[:2]
    if level == "chip":
        shutil.move(link, tmp_path / "old-chip")
        outside.mkdir()  # an empty folder elsewhere: nothing may be read from it or made in it
    else:
        shutil.move(link, outside)
    os.symlink(outside, link)
    before = listing(outside)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(), compiler, tmp_path / "b")
        for action in (cache.verify, cache.age, cache.stats):
            try:
                action()
            except trust.UntrustedFolder as e:
                # Refusing (and saying which link) is fine; following it is not.
                assert str(link) in str(e)
        assert listing(outside) == before
        cache.clear()
    assert listing(outside) == before


def test_a_compiler_writing_links_and_folders_writes_nothing_outside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.o").write_bytes(b"not yours")
    os.chmod(outside / "victim.o", 0o644)

    class Sneaky(ToyCompiler):
        def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
            super().compile(request, workdir)
            os.symlink(outside / "victim.o", workdir / "link.o")
            os.symlink(outside, workdir / "linkdir")
            (workdir / "sub").mkdir()
            (workdir / "sub" / "inner.o").write_bytes(b"nested")
            os.symlink(outside, workdir / "sub" / "deeper")

    sneaky = Sneaky(tmp_path / "calls")
    before = listing(outside)
    good = expected_files(make_request())
    caplog.set_level(logging.WARNING)
    for mode in ("enable", "disable"):
        with opcache.OpCache(settings_for(tmp_path, mode)) as cache:
            for n in range(2):  # a miss then a hit (enable), two compiles (disable)
                out = tmp_path / f"{mode}{n}"
                cache.compile(make_request(), sneaky, out)
                assert read_dir(out) == good
                assert sorted(os.listdir(out)) == sorted(good)  # no link, no folder delivered
    assert listing(outside) == before
    assert file_mode(outside / "victim.o") == 0o644
    (entry,) = entry_dirs(settings_for(tmp_path).root).values()
    assert sorted(os.listdir(entry)) == sorted([*good, MANIFEST])
    assert warnings_of(caplog) == []


def test_a_compiler_hard_linking_a_file_from_outside_leaves_it_alone(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "kernel.o"
    victim.write_bytes(b"the compiler's own cached kernel")
    os.chmod(victim, 0o644)

    class Linking(ToyCompiler):
        def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
            super().compile(request, workdir)
            os.link(victim, workdir / "kernel.o")  # as a compiler with its own cache might

    with opcache.OpCache(settings_for(tmp_path)) as cache:
        result = cache.compile(make_request(), Linking(tmp_path / "calls"), tmp_path / "a")
    assert result.status == "miss"
    assert (tmp_path / "a" / "kernel.o").read_bytes() == victim.read_bytes()
    assert file_mode(victim) == 0o644


# ------------------------------------------------------------- a real team


MEMBER_CODE = """
settings = h.make_settings({ops!r}, {base!r}, shared_group={gid}, env={env!r})
comp = h.ToyCompiler({calls!r}, size=400_000)
out = Path({out!r})
report = {{}}
with opcache.OpCache(settings, clock=lambda: time.time() + {ahead}) as cache:
    for i in {stores!r}:
        result = cache.compile(h.make_request(i), comp, out / str(i))
        good = h.read_dir(out / str(i)) == h.expected_files(h.make_request(i), comp.size)
        report[str(i)] = [result.status, good]
    if {age!r}:
        report["age"] = cache.age().as_dict()["removed_entries"]
        report["verify"] = cache.verify().as_dict()["corrupt"]
        report["stats"] = cache.stats()
report["warnings"] = keep.messages
print(json.dumps(report))
"""


@requires_root
def test_two_members_of_the_group_share_one_cache() -> None:
    with open_folder() as base:
        ops, calls = team_cache(base)

        def member(uid: int, out: str, stores: list[int], *, ahead: float = 0, age=False):
            code = MEMBER_CODE.format(
                ops=str(ops),
                base=str(base),
                gid=TEAM_GID,
                env={"ASCEND_MAX_OP_CACHE_SIZE": "1"} if age else {},
                calls=str(calls),
                out=str(base / out),
                ahead=ahead,
                stores=stores,
                age=age,
            )
            return run_as(uid, uid, CHILD_PROLOGUE + code, groups=(TEAM_GID,))

        first = member(MEMBER_A, "a", [0, 1, 2, 3])
        assert first.pop("warnings") == []
        assert first == {str(i): ["miss", True] for i in range(4)}
        # Two hours later, the other member hits the first one's entries, stores
        # its own, and ages the folder (1 MB limit): the first one's go.
        second = member(MEMBER_B, "b", [0, 9], ahead=7200)
        assert second.pop("warnings") == []
        assert second == {"0": ["hit", True], "9": ["miss", True]}
        third = member(MEMBER_B, "b", [], ahead=7200, age=True)
        assert third.pop("warnings") == []
        assert third["age"] >= 3
        assert third["verify"] == 0
        assert third["stats"]["errors"] == 0
        root = ops / "kernel_cache"
        assert trash_emptied(root) == []
        walked = entry_dirs(root)
        assert (third["stats"]["entries"], third["stats"]["bytes"]) == (
            len(walked),
            sum(tree_bytes(p) for p in walked.values()),
        )


@requires_root
@pytest.mark.parametrize("mode", [0o2777, 0o3777])
def test_an_outsider_cannot_plant_in_a_team_cache_held_by_a_folder_anyone_writes(
    mode: int,
) -> None:
    """A setgid folder of the team that others can write gives the team's id to whatever
    anyone makes in it: an outsider made ``kernel_cache`` there with a kernel for a
    member's next compile, which that member's compile then served as a hit."""
    with open_folder() as base:
        ops, calls = team_cache(base)
        os.chmod(ops, mode)
        compiler = ToyCompiler(calls, size=400_000)  # (MEMBER_CODE's)
        forge = settings_for(base / "forge")  # (a private cache of root's, to forge with)
        with opcache.OpCache(forge) as cache:
            key = cache.compile(make_request(0), compiler, base / "forge" / "out").key
        forged = entry_dirs(forge.root)[key]
        plant(forged, evil(expected_files(make_request(0), compiler.size)))
        for dirpath, _dirs, files in os.walk(base / "forge"):
            os.chmod(dirpath, 0o755)
            for name in files:
                os.chmod(os.path.join(dirpath, name), 0o644)
        target = ops / "kernel_cache" / SOC / key[:2] / key
        assert copy_as(NOBODY, forged, target) == TEAM_GID  # (the folder's gift)

        code = MEMBER_CODE.format(
            ops=str(ops), base=str(base), gid=TEAM_GID, env={}, calls=str(calls),
            out=str(base / "a"), ahead=0, stores=[0], age=False,
        )  # fmt: skip
        member = run_as(MEMBER_A, MEMBER_A, CHILD_PROLOGUE + code, groups=(TEAM_GID,))
        assert member["0"] == ["miss", True]  # compiled, the right bytes: never the plant
        (warning,) = member["warnings"]
        assert f"{ops} is setgid" in warning and "writable by others" in warning, warning
        # The rule is the root's, not the members': a team folder no outsider can write
        # is still shared by members with no name (a pod of a Kubernetes fsGroup).
        shutil.rmtree(ops / "kernel_cache")
        os.chmod(ops, 0o2770)
        assert run_as(MEMBER_A, MEMBER_A, CHILD_PROLOGUE + code, groups=(TEAM_GID,)) == {
            "0": ["miss", True], "warnings": []
        }  # fmt: skip
        code = code.replace(str(base / "a"), str(base / "b"))
        assert run_as(MEMBER_B, MEMBER_B, CHILD_PROLOGUE + code, groups=(TEAM_GID,)) == {
            "0": ["hit", True], "warnings": []
        }  # fmt: skip


needs_useradd = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd"), reason="needs root and useradd"
)


@contextlib.contextmanager
def _private_group_user(other: str) -> Iterator[tuple[pwd.struct_passwd, str]]:
    """A user with a private group of its name (useradd -U), and the name ``other``
    for a second user the test makes; both, and the group, removed after."""
    tag = f"{os.getpid() % 100000}"
    owner, other = f"opcpriv{tag}", f"{other}{tag}"
    subprocess.run(["useradd", "-M", "-U", owner], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(owner), other
    finally:
        trust._private.clear()
        subprocess.run(["userdel", other], capture_output=True)
        subprocess.run(["userdel", owner], capture_output=True)
        subprocess.run(["groupdel", owner], capture_output=True)


@needs_useradd
def test_a_member_added_to_a_private_group_is_found_by_a_long_lived_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server runs for hours: once PRIVATE_GROUP_SECONDS have gone, a group that
    gained a member is no private group any more (its 0664 files are not trusted)."""
    now = [1000.0]
    monkeypatch.setattr(trust, "_clock", lambda: now[0])
    trust._private.clear()
    with _private_group_user("opcmem") as (user, other):
        assert trust.private_group(user.pw_uid, user.pw_gid)
        subprocess.run(
            ["useradd", "-M", "-G", user.pw_name, other], check=True, capture_output=True
        )
        now[0] += trust.PRIVATE_GROUP_SECONDS - 1
        assert trust.private_group(user.pw_uid, user.pw_gid)  # (kept a while: not asked)
        now[0] += 1
        assert not trust.private_group(user.pw_uid, user.pw_gid)


@needs_useradd
def test_a_group_another_user_has_as_primary_group_is_no_private_group() -> None:
    """'useradd -g alice mallory' makes mallory a member of alice's group without
    listing her in it: a 0664 file of alice's was trusted, and mallory could write it."""
    with _private_group_user("opcmal") as (user, other):
        assert trust.private_group(user.pw_uid, user.pw_gid)
        trust._private.clear()
        subprocess.run(
            ["useradd", "-M", "-g", user.pw_name, other], check=True, capture_output=True
        )
        assert not trust.private_group(user.pw_uid, user.pw_gid)
