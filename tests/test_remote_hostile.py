"""Remote URLs and servers that try opcache's promises: a URL urlsplit refuses is a
setting's error, never a traceback.
"""

from __future__ import annotations

import pytest

from opcache import ConfigError, resolve_settings
from opcache.cli import main

# Each an unbalanced bracket, which urlsplit reads as an IPv6 host's half.
BRACKETED = [
    ("http://u:pa[ss@h/x", "percent-encode '[' and ']'"),
    ("redis+cluster://u:pa]ss@127.0.0.1:9", "percent-encode '[' and ']'"),
    ("redis://u:p[w@h:1/0", "percent-encode '[' and ']'"),
    ("http://[::1/x", "needs its ']'"),
    ("redis+cluster://[::1", "needs its ']'"),
    ("redis+cluster://h:7000,[::1:7001", "needs its ']'"),
]


@pytest.mark.parametrize(("url", "why"), BRACKETED)
def test_a_url_with_an_unbalanced_bracket_is_refused_when_read(
    tmp_path, url: str, why: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        resolve_settings(remote=url, environ={"HOME": str(tmp_path)})
    assert why in str(raised.value)
    settings = resolve_settings(environ={"HOME": str(tmp_path), "OPCACHE_REMOTE": url})
    assert settings.remote is None and why in settings.remote_error


@pytest.mark.parametrize("command", [["remote", "stats"], ["cann", "push"], ["cann", "pull"]])
def test_a_url_with_an_unbalanced_bracket_is_one_error_line(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, command
) -> None:
    """These ended in urlsplit's ``ValueError: Invalid IPv6 URL``, a traceback."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OPCACHE_REMOTE", raising=False)
    for url, why in BRACKETED:
        argv = [*command, "--remote", url, "--op_compiler_cache_dir", str(tmp_path / "ops")]
        if command[0] == "cann":
            argv += ["--soc_version", "Ascend910B1"]
        status = main(argv)
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err, err
        assert err.startswith("opcache: error: remote=") and why in err, err
        assert err.count("\n") == 1 and "pa[ss" not in err and "pa]ss" not in err


def test_what_urlsplit_refuses_is_a_problem_even_past_the_other_checks(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last check is urlsplit's own (and its port's): whatever the checks before
    miss is refused as they refuse, not a ValueError where the URL is used."""
    from opcache import settings

    monkeypatch.setattr(settings, "_form_problem", lambda url: None)
    for url in ("http://[::1/x", "redis://h:99999/0"):
        with pytest.raises(ConfigError, match="is not valid: "):
            resolve_settings(remote=url, environ={"HOME": str(tmp_path)})
    assert resolve_settings(remote="redis+cluster://h:1,h:2", environ={"HOME": str(tmp_path)})
