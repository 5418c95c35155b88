"""Hostile settings: chip names that are not chip folders, environment values
that no system call takes, and remote settings with a typo.

Issue 16, items 3, 7 and 10: a soc_version names a real chip folder of the
cache or nothing; every value is checked when the settings are read (a
ConfigError naming the variable, or for the remote a warning); a bad remote
costs the remote only, never the cache folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from helpers_wrap import opcache, wrap

from opcache import ConfigError, resolve_settings
from opcache.cli import main
from opcache.settings import check_soc_version

GCC = shutil.which("gcc")
needs_gcc = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
HUGE = "9" * 5000  # past int()'s 4,300 digits


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A clean environment with the cache in ``tmp_path/cache``, and a C file to compile."""
    (tmp_path / "k.c").write_text("int k(int x) { return 5 * x; }\n")
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(tmp_path),
        "OPCACHE_DIR": str(tmp_path / "cache"),
        "LANG": "C.UTF-8",
    }


def compile_k(env: dict[str, str], cwd: Path, *flags: str) -> str:
    """A wrapped ``gcc -c k.c``: it must exit 0 and leave k.o; returns its stderr."""
    (cwd / "k.o").unlink(missing_ok=True)
    done = wrap(GCC, "-c", "k.c", "-o", "k.o", env=env, cwd=cwd, flags=flags)
    assert (cwd / "k.o").is_file()
    return done.stderr.decode()


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("opcache: warning:")]


def local_stats(env: dict[str, str], cwd: Path) -> dict:
    return json.loads(opcache("stats", "--json", env=env, cwd=cwd).stdout)["chips"]["host"]


# -- item 3: a soc_version names a chip folder, nothing else -----------------------------


@pytest.mark.parametrize(
    "soc", ["Ascend910B1", "Ascend310P3", "Ascend910B4-1", "Ascend910_9391", "Ascend950PR_9599"]
)
def test_real_chip_names_are_accepted(soc):
    assert check_soc_version(soc) == soc


@pytest.mark.parametrize(
    "name",
    ["op_cache.ini", ".opcache", "_size", "-rf", "Ascend910B1.bak", "a" * 65, "Ascend910B1\n"],
)
def test_a_name_opcache_uses_at_the_root_or_any_dotted_name_is_refused(name):
    with pytest.raises(ConfigError, match="soc_version"):
        check_soc_version(name)


@pytest.mark.parametrize("command", ["clear", "age", "verify", "stats"])
def test_maintenance_never_acts_on_op_cache_ini_or_the_bookkeeping(tmp_path, env, command):
    root = tmp_path / "cache" / "kernel_cache"
    root.mkdir(parents=True)
    ini = root / "op_cache.ini"
    ini.write_text("[op_compiler_cache]\nmax_op_cache_size=500\nremain_cache_size_ratio=50\n")
    (root / ".opcache").mkdir()
    for name in ("op_cache.ini", ".opcache"):
        done = opcache(command, "--soc_version", name, env=env, cwd=tmp_path, status=2)
        assert done.stderr.decode().startswith("opcache: error: soc_version=")
    assert ini.read_text().startswith("[op_compiler_cache]")
    assert (root / ".opcache").is_dir()


@pytest.mark.parametrize("command", ["clear", "age", "verify", "stats"])
def test_maintenance_acts_only_on_a_real_trusted_chip_folder(tmp_path, env, command):
    root = tmp_path / "cache" / "kernel_cache"
    root.mkdir(parents=True)
    (root / ".opcache").mkdir()  # (a cache opcache stored in: its chip folders judged)
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    (outside / "ab" / "keep.o").write_text("not the cache's")
    (root / "Ascend910B1").symlink_to(outside)
    (root / "Ascend310P3").write_text("a file named like a chip")
    (root / "Ascend910B2").mkdir()
    (root / "Ascend910B2").chmod(0o777)  # anyone could have put anything there
    for soc, why in (
        ("Ascend910B1", "a link or a file"),
        ("Ascend310P3", "a link or a file"),
        ("Ascend910B2", "writable by others"),
    ):
        done = opcache(command, "--soc_version", soc, env=env, cwd=tmp_path, status=1)
        said = done.stderr.decode()
        assert said.startswith(f"opcache: error: {root / soc} is not a chip folder"), said
        assert why in said
    assert (root / "Ascend910B1").is_symlink() and (outside / "ab" / "keep.o").exists()
    assert (root / "Ascend310P3").read_text() == "a file named like a chip"
    assert (root / "Ascend910B2").is_dir()


# -- item 7: every value is checked when the settings are read --------------------------


@pytest.mark.parametrize("value", ["4294967296", "4294967295", HUGE, "-1"])
def test_a_group_id_chown_cannot_take_is_a_config_error(tmp_path, value):
    with pytest.raises(ConfigError) as caught:
        resolve_settings(environ={"HOME": str(tmp_path), "OPCACHE_SHARED_GROUP": value})
    assert caught.value.variable == "OPCACHE_SHARED_GROUP"
    assert len(str(caught.value)) < 300  # names the value without 5,000 digits of it
    assert resolve_settings(shared_group=4294967294, environ={}).shared_group == 4294967294


@pytest.mark.parametrize(
    "variable",
    [
        "HOME",
        "ASCEND_CACHE_PATH",
        "NPU_COLLECT_PATH",
        "OPCACHE_SHARED_GROUP",
        "OPCACHE_SESSION",
        "OPCACHE_DIR",
        "OPCACHE_MODE",
        "OPCACHE_DISABLE",
        "OPCACHE_BASE_DIR",
    ],
)
def test_a_nul_through_environ_is_a_config_error_naming_the_variable(tmp_path, variable):
    environ = {"HOME": str(tmp_path), "OPCACHE_DIR": str(tmp_path / "c"), variable: "/x\0y"}
    with pytest.raises(ConfigError) as caught:
        resolve_settings(environ=environ)
    assert caught.value.variable == variable


def test_a_relative_home_is_not_a_cache_in_every_compile_folder(tmp_path):
    with pytest.raises(ConfigError) as caught:
        resolve_settings(environ={"HOME": "relative/home"})
    assert caught.value.variable == "HOME"
    # Not read at all when the cache folder is given.
    assert resolve_settings(op_compiler_cache_dir=str(tmp_path), environ={"HOME": "x"})


def test_a_session_of_undecodable_bytes_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as caught:
        resolve_settings(environ={"HOME": str(tmp_path), "OPCACHE_SESSION": "build\udcff"})
    assert caught.value.variable == "OPCACHE_SESSION"


@needs_gcc
@pytest.mark.parametrize("value", ["4294967296", HUGE])
def test_a_group_id_out_of_range_never_fails_a_wrapped_compile(tmp_path, env, value):
    said = compile_k({**env, "OPCACHE_SHARED_GROUP": value}, tmp_path)
    assert len(warnings(said)) == 1 and "OPCACHE_SHARED_GROUP=" in said


@needs_gcc
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OPCACHE_REMOTE_MAX_ENTRY_MB", HUGE),
        ("OPCACHE_REMOTE_TTL", HUGE),
        ("OPCACHE_REMOTE", "redis://" + "h" * 64 + ":6379/0"),  # a label over 63 characters
        ("OPCACHE_REMOTE", "redis://127.0.0.1:6379/0?foo=bar"),  # redis-py: a TypeError
    ],
)
def test_a_remote_value_no_client_takes_never_fails_a_wrapped_compile(
    tmp_path, env, variable, value
):
    env = {"OPCACHE_REMOTE": "redis://127.0.0.1:1/0", **env, variable: value}
    said = compile_k(env, tmp_path)
    assert len(warnings(said)) == 1 and f"{variable}=" in said, said
    compile_k(env, tmp_path)  # the cache folder is in use: a hit
    assert local_stats(env, tmp_path)["hits"] == 1


# -- item 10: a bad remote costs the remote only -------------------------------------------


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://cache:6379/0", "use a URL"),
        ("redis://cache:abc/0", "port"),
        ("redis://cache:999999/0", "port"),
        ("redis://cache:0/0", "port"),
        ("redis://cache/xyz", "database"),
        ("redis://cache:6379/0?db=x", "db="),
        ("redis://cache:6379/0?socket_timeout=100", "query"),  # opcache's timeouts stay
        ("redis://cache:6379/0?ssl_ca_certs=/ca.pem", "query"),  # TLS options: rediss only
        ("redis://:6379/0", "host"),
        ("redis://" + "h" * 64 + "/0", "host"),
        ("redis://a..b/0", "host"),
        ("redis://[::zz]:6379/0", "IPv6"),
        ("redis://ca che/0", "spaces"),
        ("redis://cache/0#x", "'#'"),
        ("unix://cache/redis.sock", "unix:///"),
        ("file:///mnt/a%00b", "control characters"),  # (os calls raise ValueError on it)
        ("file:///mnt/a%0Ab", "control characters"),
        ("file:///mnt/a%09b", "control characters"),
    ],
)
def test_a_remote_url_with_a_typo_is_refused_when_read(tmp_path, url, why, caplog):
    with pytest.raises(ConfigError) as caught:
        resolve_settings(remote=url, environ={"HOME": str(tmp_path)})
    assert why in str(caught.value) and caught.value.variable is None
    with caplog.at_level(logging.WARNING, logger="opcache"):
        settings = resolve_settings(environ={"HOME": str(tmp_path), "OPCACHE_REMOTE": url})
    assert settings.remote is None and why in settings.remote_error
    assert settings.remote_error.startswith("OPCACHE_REMOTE=")
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_a_nul_in_a_remote_folder_s_path_is_one_error_line(tmp_path, monkeypatch, capsys):
    """``opcache remote stats`` with such a URL ended in os.stat's ValueError."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OPCACHE_REMOTE", "file:///tmp/a%00b")
    status = main(["remote", "stats", "--op_compiler_cache_dir", str(tmp_path / "ops")])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("opcache: error: OPCACHE_REMOTE='file:///tmp/a%00b'")


@pytest.mark.parametrize(
    "url",
    [
        "redis://cache-host:6379/0",
        "redis://ci-writer:s3cret@cache.example.com:6380/15",
        "redis://10.0.0.7",
        "redis://[::1]:6379/2",
        "redis://redis_1/0",
        "redis://cache/0?db=3",
        "rediss://cache:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required",
        "unix:///run/redis/redis.sock",
        "unix:///run/redis/redis.sock?db=2",
    ],
)
def test_remote_urls_a_cluster_uses_are_accepted(url):
    assert resolve_settings(remote=url, environ={}).remote.url == url


def test_a_bad_remote_option_in_the_environment_leaves_the_remote_out(tmp_path, caplog):
    environ = {
        "HOME": str(tmp_path),
        "OPCACHE_REMOTE": "redis://cache:6379/0",
        "OPCACHE_REMOTE_TIMEOUT": "abc",
    }
    with caplog.at_level(logging.WARNING, logger="opcache"):
        settings = resolve_settings(environ=environ)
    assert settings.remote is None and settings.mode == "disable"
    assert settings.remote_error.startswith("OPCACHE_REMOTE_TIMEOUT='abc' is not valid")
    assert "OPCACHE_REMOTE_TIMEOUT" in caplog.text and "not using the remote" in caplog.text
    # Given by the caller, the same value is the caller's error.
    with pytest.raises(ConfigError, match="remote timeout='abc'"):
        resolve_settings(remote={"url": "redis://cache/0", "timeout": "abc"}, environ={})


@needs_gcc
@pytest.mark.parametrize(
    ("variable", "value"),
    [("OPCACHE_REMOTE", "ftp://cache:6379/0"), ("OPCACHE_REMOTE_TIMEOUT", "abc")],
)
def test_a_remote_typo_keeps_the_local_cache_and_the_commands(tmp_path, env, variable, value):
    env = {**env, "OPCACHE_REMOTE": "redis://127.0.0.1:1/0", variable: value}
    first = compile_k(env, tmp_path)
    assert len(warnings(first)) == 1 and f"{variable}=" in first
    assert "without the cache" not in first
    assert warnings(compile_k(env, tmp_path)) == []  # said once an hour, not per compile
    assert local_stats(env, tmp_path)["hits"] == 1
    stats = opcache("stats", env=env, cwd=tmp_path).stderr.decode()
    assert f"{variable}=" in stats and "not using the remote" in stats
    shown = json.loads(opcache("config", "--json", env=env, cwd=tmp_path).stdout)
    assert shown["remote"] is None and shown["remote_error"].startswith(f"{variable}=")
    # The remote's own commands cannot work without it: an error that says why.
    said = opcache("remote", "stats", env=env, cwd=tmp_path, status=2).stderr.decode()
    assert said.splitlines()[-1].startswith(f"opcache: error: {variable}=")
    # On opcache's own command line, the same mistake is an error.
    flag = ["--remote", "ftp://cache:6379/0"]
    opcache("remote", "stats", *flag, env=env, cwd=tmp_path, status=2)


# -- credentials are never shown ------------------------------------------------------------


def files_holding(folder: Path, secret: str) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@needs_gcc
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OPCACHE_REMOTE_PASSWORD", "TOPSECRET-token\n"),  # a secret file's last line break
        ("OPCACHE_REMOTE_PASSWORD", "TOPSECRET\r\nX-Evil: 1"),
        ("OPCACHE_REMOTE", "http://:TOPSECRET%0A@127.0.0.1:1/c"),  # decoded from the URL
        ("OPCACHE_REMOTE", "http://ci:TOPSECRET%00@127.0.0.1:1/c"),
    ],
)
def test_a_credential_with_a_control_character_is_refused_and_never_shown(
    tmp_path, env, variable, value
):
    """http.client refuses such a header and quotes it whole in its error, which every
    compile printed: the credential is refused when read, with a line naming the variable."""
    env = {**env, "OPCACHE_REMOTE": "http://127.0.0.1:1/c", variable: value}
    said = compile_k(env, tmp_path)
    assert len(warnings(said)) == 1 and f"{variable}=" in said and "control" in said
    stats = opcache("stats", "-v", env=env, cwd=tmp_path).stderr.decode()
    assert "TOPSECRET" not in said + stats and not files_holding(tmp_path / "cache", "TOPSECRET")
    with pytest.raises(ConfigError, match="control") as caught:
        resolve_settings(remote={"url": env["OPCACHE_REMOTE"], "password": value}, environ={})
    assert "TOPSECRET" not in str(caught.value)


@needs_gcc
def test_query_values_of_a_remote_url_are_masked_in_warnings_stats_and_files(tmp_path, env):
    """``?ssl_password=`` is a TLS key's passphrase: never printed, never in the stats file."""
    url = "rediss://127.0.0.1:1/0?db=0&ssl_password=KEY-PASSPHRASE&ssl_cert_reqs=none"
    env = {**env, "OPCACHE_REMOTE": url}
    said = compile_k(env, tmp_path)
    shown = "rediss://127.0.0.1:1/0?db=0&ssl_password=***&ssl_cert_reqs=none"
    assert len(warnings(said)) == 1 and shown in said, said
    stats = opcache("stats", "-v", env=env, cwd=tmp_path)
    printed = stats.stdout.decode() + stats.stderr.decode()
    assert shown in printed and "PASSPHRASE" not in said + printed
    assert not files_holding(tmp_path / "cache", "PASSPHRASE")


@pytest.mark.parametrize(
    "url",
    [
        "redis://ci:Xy7s3cr/et+K@cache-host:6379/0",  # (base64 passwords hold '/')
        "rediss://ci:a.b.c.long-Secret/xx@h",
        "redis://u:pa?ssWORD@host",
        "http://u:Xy7s3cr/etK@h/cache",
        "redis+cluster://u:Xy7s3cr/etK@h1:7000,h2:7000",
        "https://deploy:2024/Secret@cache.example.com/opcache",  # (a port, or a password?)
    ],
)
def test_a_password_holding_a_slash_or_question_mark_is_never_quoted(url, caplog):
    """Read as it is, the password's first part was the port, quoted in the warning of
    every compile ('the port 'Xy7s3cr' is not a number'), and the shown URL kept it."""
    with pytest.raises(ConfigError, match="percent-encode") as caught:
        resolve_settings(remote={"url": url}, environ={"HOME": "/nonexistent"})
    with caplog.at_level(logging.WARNING, logger="opcache"):
        resolve_settings(environ={"OPCACHE_REMOTE": url, "HOME": "/nonexistent"})
    secret = url.partition("://")[2].rpartition("@")[0].partition(":")[2]
    pieces = [secret[i : i + 3] for i in range(len(secret) - 2)]
    for said in (str(caught.value), caplog.text):
        assert "percent-encode" in said
        assert not [p for p in pieces if p in said.replace("percent-encode", "")], said


@pytest.mark.parametrize(
    "url",
    [
        "file:///mnt/a@b/c",
        "rediss://cache.corp:6380?ssl_ca_certs=/home/john@corp.example.com/ca.pem",  # (SSSD)
        "rediss+cluster://h1:7000?ssl_ca_certs=/etc/ssl/team@x/ca.pem",
        "https://cache.example.com/artifactory/opcache@team/",
    ],
)
def test_an_at_sign_in_a_path_or_an_option_s_value_is_a_name(url):
    settings = resolve_settings(environ={"OPCACHE_REMOTE": url, "HOME": "/x"})
    assert settings.remote is not None and settings.remote.shown_url == url
