"""Fuzz every environment variable opcache reads: a wrapped compile still makes its object.

Issue 16, "Done when": huge, negative, non-ASCII, newline, undecodable and
over-long values, in any mix, in every variable opcache (or the compile it
wraps, through opcache) reads.  Whatever they hold, ``opcache wrap -- gcc -c``
exits 0, leaves the object a plain gcc makes, and raises nothing: a bad value
is at most a warning and an uncached compile.

The wraps run in-process (``cli.main``, as ``opcache wrap`` does) for speed;
the compiler is the real gcc.  The tests run as root on CI: no value may name
a folder outside the test's own, so absolute paths are put under it and
``..`` and ``~user`` are defused.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from opcache import settings as opcache_settings
from opcache.cli import main

GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")

# Every variable opcache reads (settings.py, cli.py, wrap.py, masquerade.py,
# compilers/), whether it configures the cache or only the compile it wraps.
VARIABLES = (
    "HOME",
    "PATH",
    "PWD",
    "TERM",
    "CC",
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "OBJC_INCLUDE_PATH",
    "TUNE_BANK_PATH",
    "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME",
    "ASCEND_OPP_PATH",
    opcache_settings.ENV_CACHE_PATH,
    opcache_settings.ENV_MAX_SIZE,
    opcache_settings.ENV_RATIO,
    opcache_settings.ENV_COLLECT_PATH,
    opcache_settings.ENV_SHARED_GROUP,
    opcache_settings.ENV_SESSION,
    opcache_settings.ENV_REMOTE,
    *(variable for variable, _ in opcache_settings.REMOTE_OPTIONS.values()),
    opcache_settings.ENV_DIR,
    opcache_settings.ENV_MODE,
    opcache_settings.ENV_DISABLE,
    opcache_settings.ENV_BASE_DIR,
    opcache_settings.ENV_VERBOSE,
    "OPCACHE_RAN",
)

TEXT = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")
VALUES = st.one_of(
    st.integers().map(str),  # negative, zero, big
    st.sampled_from(["9" * 5000, "-" + "9" * 5000, "4294967296", "-1", "0", "1e999", "nan"]),
    st.text(TEXT, max_size=40),  # non-ASCII, control characters, newlines
    st.text(TEXT, max_size=10).map(lambda t: f"{t}\n{t}\r\n"),
    st.binary(max_size=20)  # bytes of no encoding, as a environment may hold them
    .filter(lambda b: b"\0" not in b)
    .map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.sampled_from(["x" * 300, "a/" * 3000, "/" + "b" * 256]),  # too long for a name or path
    st.builds(
        "redis://{}:{}/{}".format,
        st.sampled_from(["127.0.0.1", "h" * 64, "", "[::1]", "a..b", "bad host"]),
        st.sampled_from(["1", "abc", "999999", "-5", ""]),
        st.sampled_from(["0", "xyz", "0?foo=bar", "0?db=x", ""]),
    ),
)
ENVIRONMENTS = st.dictionaries(st.sampled_from(VARIABLES), VALUES, min_size=1, max_size=6)
HUGE = "9" * 5000


def defused(value: str, folder: Path) -> str:
    """``value`` naming nothing outside ``folder``, however a path is made of it."""
    value = value.replace("..", "__")
    if value.startswith("~") and not value.startswith("~/"):
        value = "_" + value[1:]  # ~user: another account's home
    return f"{folder}{value}" if value.startswith("/") else value


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """(a folder with k.c, the object a plain gcc makes of it)."""
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "src").mkdir()
    (folder / "src" / "k.c").write_text("int k(int x) { return 7 * x + 1; }\n")
    subprocess.run([GCC, "-c", "k.c", "-o", "first.o"], cwd=folder / "src", check=True)
    return folder, (folder / "src" / "first.o").read_bytes()


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(fuzzed=ENVIRONMENTS)
# Each value that once failed a wrapped compile (issue 16, item 7), always tried.
@example(fuzzed={"OPCACHE_SHARED_GROUP": "4294967296"})  # OverflowError from os.chown
@example(fuzzed={"OPCACHE_SHARED_GROUP": HUGE})  # ValueError: int()'s digit limit
@example(fuzzed={"OPCACHE_REMOTE_MAX_ENTRY_MB": HUGE, "OPCACHE_REMOTE_TTL": HUGE})
@example(fuzzed={"OPCACHE_REMOTE": "redis://" + "h" * 64 + ":1/0"})  # UnicodeError (idna)
@example(fuzzed={"OPCACHE_REMOTE": "redis://127.0.0.1:1/0?foo=bar"})  # TypeError in redis-py
@example(fuzzed={"OPCACHE_SESSION": "build\udcff", "OPCACHE_MODE": "force"})
@example(fuzzed={"CPATH": "\udc80"})  # not JSON text
def test_a_wrapped_compile_survives_any_environment(project, fuzzed):
    folder, plain = project
    src = folder / "src"
    # A new cache folder each time: its folders are made (and chowned) again.
    cache = folder / "cache" / os.urandom(6).hex()
    environ = {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(folder / "home"),
        "OPCACHE_DIR": str(cache),
        # Nothing listens on port 1: each remote option is read and the remote refused.
        "OPCACHE_REMOTE": "redis://127.0.0.1:1/0",
        "LANG": "C.UTF-8",
    }
    for name, value in fuzzed.items():
        value = defused(value, folder)
        # PATH keeps finding gcc; the fuzzed part comes after.
        environ[name] = f"{environ['PATH']}{os.pathsep}{value}" if name == "PATH" else value
    # gcc reads some of them too (CPATH, PATH...): what it makes of them, plainly.
    (src / "plain.o").unlink(missing_ok=True)
    gcc = subprocess.run([GCC, "-c", "k.c", "-o", "plain.o"], env=environ, cwd=src, check=False)
    (src / "k.o").unlink(missing_ok=True)
    stderr = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace")
    cwd = os.getcwd()
    try:
        os.chdir(src)
        with mock.patch.dict(os.environ, environ, clear=True), contextlib.redirect_stderr(stderr):
            status = main(["wrap", "--", "gcc", "-c", "k.c", "-o", "k.o"])
    finally:
        os.chdir(cwd)
    stderr.flush()
    said = stderr.buffer.getvalue().decode("utf-8", "backslashreplace")  # type: ignore[attr-defined]
    assert "Traceback" not in said
    assert status == gcc.returncode, said
    if gcc.returncode == 0:  # (else gcc itself refused the environment, as it does plainly)
        assert (src / "k.o").read_bytes() == plain
