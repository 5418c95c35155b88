"""Remote URLs and servers that try opcache's promises: a URL urlsplit refuses is a
setting's error, never a traceback; a server without HELLO is used, and never
shown the password it quotes back; a server's own words never reach the terminal
raw; an answer past the entry cap is cut off; connecting is within the deadline
(Redis's: the connect limit) however many addresses a name has, TLS still spoken;
an answer that is no value is a corrupt one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers_cache import SOC, ToyCompiler, compile_within, fake_server, machine, make_request
from helpers_cluster import _CLUSTER_ARGS, _cluster_port
from helpers_redis import RedisServer, find_server

import opcache
from opcache import ConfigError, resolve_settings
from opcache.cli import main
from opcache.storage import RemoteCorrupt, RemoteError, open_remote
from opcache.storage.entry import make_manifest

KEY = "0123456789abcdef" * 2

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


# -- a server without HELLO (Redis 5, or one that renamed it away) --------------------------


class _Resp2Server(RedisServer):
    """A redis-server the helpers' client (RESP3 with redis-py 8) cannot talk to without
    HELLO: theirs told to speak RESP2."""

    def client(self, **options: object):  # type: ignore[no-untyped-def]
        return super().client(protocol=2, **options)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """``started(*options)``: a redis-server of this test's own, with ``options``."""
    binary = find_server()
    if binary is None:
        pytest.skip("no redis-server")
    servers: list[RedisServer] = []

    def start(*options: str) -> RedisServer:
        server = _Resp2Server(binary, tmp_path / f"redis{len(servers)}")
        if "--cluster-enabled" in options:
            server.port = _cluster_port()  # (its bus port, 10000 above, free too)
        servers.append(server)
        server.start(*options)
        return server

    yield start
    for server in servers:
        server.stop()


def _open(url: str, password: str | None = None):  # type: ignore[no-untyped-def]
    env = {"HOME": "/nowhere"} | ({} if password is None else {"OPCACHE_REMOTE_PASSWORD": password})
    return open_remote(resolve_settings(remote={"url": url}, environ=env).remote)


def _entry() -> tuple[bytes, dict[str, bytes]]:
    files = {"k.o": b"\x7fELF" * 100}
    return make_manifest(KEY, files, 1.0, {"op_type": "Add"}, 1000.0), files


def _one_node_clusters(nodes: list[RedisServer]) -> list[str]:
    """The URLs of ``nodes``, started cluster nodes, each made a cluster of its own
    (together: each waits a while after its start before it says it is whole)."""
    for node in nodes:
        node.client().execute_command("CLUSTER ADDSLOTS", *range(16384))
    deadline = time.monotonic() + 10
    for node in nodes:
        while node.client().execute_command("CLUSTER INFO")["cluster_state"] != "ok":
            assert time.monotonic() < deadline, "a one node cluster is not whole"
            time.sleep(0.02)
    return [f"redis+cluster://127.0.0.1:{node.port}" for node in nodes]


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_a_server_without_hello_is_used_with_or_without_a_password(started, scheme) -> None:
    """redis-py 8 opens with ``HELLO 3``: such a server refused every connection."""
    options = ("--rename-command", "HELLO", "", *(_CLUSTER_ARGS if "cluster" in scheme else ()))
    plain, locked = started(*options), started(*options)
    urls = [node.url for node in (plain, locked)]
    if "cluster" in scheme:
        urls = _one_node_clusters([plain, locked])
    locked.client().config_set("requirepass", "sesame")
    for r in (_open(urls[0]), _open(urls[1], "sesame")):
        assert r.put(SOC, KEY, *_entry()) > 0
        assert r.get(SOC, KEY) is not None
        claim = r.claim(SOC, "f" * 32, 5)  # (the claims' scripts, answered in RESP2)
        assert claim is not None and claim.owned
        claim.release()
        assert r.usage()["chips"][SOC]["entries"] == 1
        r.close()
    with pytest.raises(RemoteError, match=r"wants a password|cannot use"):
        _open(urls[1]).get(SOC, KEY)


LONG = "L0ng-" + "x" * 200  # past the 128 characters Redis quotes of a refused command


@pytest.mark.parametrize(
    ("written", "password", "sent"),
    [
        ("", "sesame", "sesame"),
        ("", LONG, LONG),
        ("u:se%5Bsa%40me@", None, "se[sa@me"),  # percent-decoded from the URL, then sent
    ],
    ids=["env", "long", "url"],
)
def test_a_password_the_server_quotes_back_is_never_shown(
    started, tmp_path: Path, monkeypatch, capsys, caplog, written, password, sent
) -> None:
    """A server without the command that carries the password (HELLO, AUTH) refuses it
    quoting its arguments: "unknown command `HELLO`, with args beginning with: `3`,
    `AUTH`, `default`, `sesame`", which went into the warning and the error line."""
    server = started("--rename-command", "HELLO", "", "--rename-command", "AUTH", "")
    url = f"redis://{written}127.0.0.1:{server.port}"
    with pytest.raises(RemoteError) as raised:
        _open(url, password).get(SOC, KEY)
    message = str(raised.value)
    assert "unknown command" in message, message
    shown = [message]
    with caplog.at_level(logging.WARNING, logger="opcache"):
        result, _ = compile_within(tmp_path, url, password=password)
    assert result.status == "miss" and "not used for" in caplog.text
    shown.append(caplog.text)
    monkeypatch.setenv("HOME", str(tmp_path))
    if password is not None:
        monkeypatch.setenv("OPCACHE_REMOTE_PASSWORD", password)
    argv = ["remote", "stats", "--remote", url, "--op_compiler_cache_dir", str(tmp_path / "o2")]
    assert main(argv) == 1
    shown.append(capsys.readouterr().err)
    assert shown[-1].startswith("opcache: error: ")
    for text in shown:
        assert sent[:8] not in text and "se%5Bsa" not in text, text


# -- a server's own words ---------------------------------------------------------------------

# A status line, or an error, that clears the screen and writes a line of opcache's own.
FAKE = b"\x1b[2J\x1b[31mFAKE: opcache: error: all good\x1b[0m\rX"


@contextlib.contextmanager
def fake_redis(reply: Callable[[list[bytes]], bytes | None]) -> Iterator[int]:
    """The port of a server speaking enough of Redis's protocol to be connected to (and of
    RESP3's, for the code before RESP2 was asked for), that answers each command
    ``reply`` gives an answer to with it, and any other with ``+OK``."""

    def answer(conn: socket.socket, ended: threading.Event) -> None:
        commands = conn.makefile("rb")
        while not ended.is_set() and (line := commands.readline()):
            words = [commands.read(int(commands.readline()[1:]) + 2)[:-2]
                     for _ in range(int(line[1:]))]  # fmt: skip
            given = reply(words)
            if given is not None:
                conn.sendall(given)
            elif words[0].upper() == b"HELLO":
                conn.sendall(b"%1\r\n+proto\r\n:3\r\n")
            else:
                conn.sendall(b"+OK\r\n")

    with fake_server(answer) as port:
        yield port


def _no_control_character(text: str) -> None:
    assert not any(c in text for c in "\x1b\r\x07"), repr(text)


def test_a_redis_server_s_error_never_reaches_the_terminal_raw(
    tmp_path: Path, monkeypatch, capsys, caplog
) -> None:
    """The server's error text went into the warning and the ``opcache: error:`` line
    as it was: a ``\\x1b[2J`` cleared the screen, a ``\\r`` wrote a fake line over ours."""

    def reply(words: list[bytes]) -> bytes | None:
        if words[0].upper() in (b"GET", b"SCAN"):
            return b"-" + FAKE + b" " + b"y" * 100_000 + b"\r\n"
        return None

    with fake_redis(reply) as port:
        url = f"redis://127.0.0.1:{port}/0"
        with caplog.at_level(logging.WARNING, logger="opcache"):
            result, _ = compile_within(tmp_path, url)
        assert result.status == "miss" and "FAKE" in caplog.text
        monkeypatch.setenv("HOME", str(tmp_path))
        argv = ["remote", "stats", "--remote", url, "--op_compiler_cache_dir", str(tmp_path / "o")]
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("opcache: error: ") and err.count("\n") == 1 and "FAKE" in err
    for text in (caplog.text, err):
        _no_control_character(text)
        assert "\\x1b[2J" in text  # (escaped, as repr writes it: still legible)
    assert len(err) < 2000  # (the server's 100,000 bytes of it: cut short)


def test_an_http_server_s_status_line_never_reaches_the_terminal_raw(
    tmp_path: Path, caplog
) -> None:
    """http.client's BadStatusLine holds the server's status line, which went into the
    warning as it was."""

    def answer(conn: socket.socket, ended: threading.Event) -> None:
        conn.recv(65536)
        conn.sendall(FAKE + b"\r\n\r\n")

    with fake_server(answer) as port:
        url = f"http://127.0.0.1:{port}/c"
        with caplog.at_level(logging.WARNING, logger="opcache"):
            result, _ = compile_within(tmp_path, url)
        with pytest.raises(RemoteError) as raised:
            open_remote(resolve_settings(remote=url, environ={"HOME": "/nowhere"}).remote).get(
                SOC, KEY
            )
    assert result.status == "miss" and "FAKE" in caplog.text
    for text in (caplog.text, str(raised.value)):
        _no_control_character(text)


def test_a_name_with_control_characters_is_no_chip_of_this_cache(redis_url: str) -> None:
    """A chip's name in ``opcache remote stats`` is part of a key name on the server,
    which anyone who may write there chooses: one no soc_version can have is none of
    this cache's, neither listed (raw, it cleared the screen) nor cleared."""
    r = _open(redis_url)
    r.put(SOC, KEY, *_entry())
    r._redis.set(f"opcache:1:\x1b[2J\rFAKE:{KEY}", b"x")
    assert sorted(r.usage()["chips"]) == [SOC]
    assert r.clear() == 1
    assert r._redis.keys("*") == [f"opcache:1:\x1b[2J\rFAKE:{KEY}".encode()]
    r.close()


@pytest.mark.parametrize("odd", ["STRLEN", "INFO"])
def test_odd_answers_to_remote_stats_end_in_one_line_or_are_shown_safe(
    tmp_path: Path, monkeypatch, capsys, odd: str
) -> None:
    """A proxy or another program speaking RESP: a STRLEN answered with text ended
    ``opcache remote stats`` in a traceback (int() of it), an INFO whose maxmemory
    was not a number too (abs() of it), and its eviction policy reached the terminal
    with its escape sequences."""
    name = f"opcache:1:{SOC}:{KEY}".encode()
    policy = b"\x1b[2J\x1b[31mPWNED"

    def reply(words: list[bytes]) -> bytes | None:
        command = words[0].upper()
        if command == b"SCAN":
            return b"*2\r\n$1\r\n0\r\n*1\r\n$%d\r\n%s\r\n" % (len(name), name)
        if command == b"STRLEN":
            return b"$10\r\nnotanumber\r\n" if odd == "STRLEN" else b":100\r\n"
        if command == b"INFO":
            info = b"# Memory\r\nused_memory:xyz\r\nmaxmemory:-5\r\nmaxmemory_policy:" + policy
            return b"$%d\r\n%s\r\n" % (len(info), info)
        return None

    monkeypatch.setenv("HOME", str(tmp_path))
    with fake_redis(reply) as port:
        url = f"redis://127.0.0.1:{port}/0"
        argv = ["remote", "stats", "--remote", url, "--op_compiler_cache_dir", str(tmp_path / "o")]
        status = main(argv)
    out, err = capsys.readouterr()
    if odd == "STRLEN":
        assert status == 1
        assert err.startswith("opcache: error: ") and err.count("\n") == 1, err
        assert "STRLEN answered" in err
    else:
        assert status == 0, err
        _no_control_character(out + err)
        assert "PWNED" in out


# -- an answer past what its command asked for --------------------------------------------------


@pytest.fixture
def flooding() -> Iterator[tuple[str, list[int]]]:
    """(host:port, [bytes sent]) of a server speaking enough of Redis's protocol (and a
    cluster's) that answers its first GET or MGET with a value announced at 4 GB and
    sends 128 MiB of it as fast as it can, until the client hangs up; every later
    one, that no key is there."""
    sent: list[int] = []

    def answer(conn: socket.socket, ended: threading.Event) -> None:
        conn.settimeout(5)  # (a client that neither reads nor hangs up: the test fails)
        commands = conn.makefile("rb")
        while not ended.is_set() and (line := commands.readline()):
            words = [commands.read(int(commands.readline()[1:]) + 2)[:-2]
                     for _ in range(int(line[1:]))]  # fmt: skip
            name = words[0].upper()
            if name == b"HELLO":  # (the code before asked for RESP3)
                conn.sendall(b"%1\r\n+proto\r\n:3\r\n")
            elif name == b"CLUSTER":  # (SLOTS: every slot is this server's)
                here = b"$9\r\n127.0.0.1\r\n:%d\r\n" % port
                conn.sendall(b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n" + here)
            elif name == b"COMMAND":
                conn.sendall(b"*0\r\n")
            elif name in (b"GET", b"MGET") and not sent:
                sent.append(0)
                count = len(words) - 1
                conn.sendall((b"*%d\r\n" % count if name == b"MGET" else b"") + b"$4000000000\r\n")
                chunk = bytes(1 << 20)
                while sent[0] < 128 << 20 and not ended.is_set():
                    conn.sendall(chunk)
                    sent[0] += len(chunk)
                ended.wait()
            elif name == b"GET":
                conn.sendall(b"$-1\r\n")
            elif name == b"MGET":
                conn.sendall(b"*%d\r\n" % (len(words) - 1) + b"$-1\r\n" * (len(words) - 1))
            else:
                conn.sendall(b"+PONG\r\n" if name == b"PING" else b"+OK\r\n")

    with fake_server(answer) as port:
        yield f"127.0.0.1:{port}", sent


def _within(seconds: float, call: Callable[[], object]) -> object:
    """``call()``'s answer (or exception, returned), in a thread given ``seconds``."""
    done: list[object] = []

    def run() -> None:
        try:
            done.append(call())
        except Exception as e:
            done.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, f"still reading after {seconds} s"
    return done[0]


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
@pytest.mark.parametrize("keys", [1, 3])
def test_an_answer_past_the_entry_cap_is_cut_off_and_its_connection_dropped(
    flooding, scheme: str, keys: int
) -> None:
    """A GET answered ``$4000000000`` and zeros as fast as they go was read on (a
    second a MiB more each MiB): a compile held 131 s with a timeout of 2 s, 11.7 GB
    of memory.  Now a GET's value or an MGET's answer is cut off past the entry cap
    for each value asked (here 1 MB), well within the timeout."""
    hostport, sent = flooding
    env = {"HOME": "/nowhere"}
    url = f"{scheme}://{hostport}"
    settings = resolve_settings(remote={"url": url, "max_entry_mb": 1, "timeout": 2}, environ=env)
    r = open_remote(settings.remote)
    wanted = [f"{i:032x}" for i in range(keys)]
    got = _within(20, lambda: r.get_many(SOC, wanted))
    if isinstance(got, RemoteError):
        assert "an answer past" in str(got) and hostport in str(got), got
    else:  # (one key, a GET: its value is corrupt, and stored over once compiled)
        assert isinstance(got, dict) and isinstance(got[wanted[0]], RemoteCorrupt), got
    assert sent[0] < 32 << 20  # (read up to the cap and a little, in the sockets' buffers)
    assert r.get_many(SOC, wanted) == {}  # (a new connection: not the answer's rest)
    r.close()


# -- a host name of many addresses, none answering ----------------------------------------------


@pytest.fixture
def unreachable(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A host name whose 40 addresses all let a connect hang: a loopback port whose
    listener's queue is full (the kernel drops the SYNs, as a blackholed address)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))  # (the queue's one place)
    resolve = socket.getaddrinfo

    def addresses(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host != "blackholed.test":
            return resolve(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))] * 40

    monkeypatch.setattr(socket, "getaddrinfo", addresses)
    yield f"blackholed.test:{port}"
    filler.close()
    listener.close()


def test_connecting_to_an_http_server_is_within_the_request_s_deadline(unreachable) -> None:
    """Each address got the whole timeout: a name with 3 unreachable addresses held a
    request 3 times as long (40 here: 40 times)."""
    timeout = 0.25
    settings = resolve_settings(
        remote={"url": f"http://{unreachable}/c", "timeout": timeout}, environ={"HOME": "/x"}
    )
    r = open_remote(settings.remote)
    start = time.monotonic()
    got = _within(60, lambda: r.get(SOC, KEY))
    assert isinstance(got, RemoteError), got
    assert time.monotonic() - start < 10 * timeout


@pytest.mark.parametrize("scheme", ["redis", "rediss", "redis+cluster", "rediss+cluster"])
def test_connecting_to_a_redis_server_is_bounded(unreachable, scheme: str) -> None:
    """redis-py gave each address the whole connect limit (a quarter of the timeout, at
    most 0.5 s): 40 addresses held a compile 40 times as long, 10 s here.  Now the limit
    is for all of a name's addresses together (a cluster's nodes' too, and with TLS)."""
    timeout = 1.0
    url = f"{scheme}://{unreachable}"
    settings = resolve_settings(remote={"url": url, "timeout": timeout}, environ={"HOME": "/x"})
    got = _within(3 * timeout, lambda: open_remote(settings.remote).get(SOC, KEY))
    assert isinstance(got, RemoteError), got


def _listen_elsewhere(monkeypatch: pytest.MonkeyPatch, port: int) -> str:
    """A host name whose first address refuses a connect, its second listening at ``port``
    (of 127.0.0.1)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refusing = closed.getsockname()[1]
    resolve = socket.getaddrinfo

    def addresses(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host != "twofold.test":
            return resolve(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", p))
                for p in (refusing, port)]  # fmt: skip

    monkeypatch.setattr(socket, "getaddrinfo", addresses)
    return f"twofold.test:{port}"


def test_a_redis_server_is_reached_at_a_name_s_next_address(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The addresses are tried in turn, as redis-py's own connect tried them."""
    port = int(redis_url.rpartition(":")[2].partition("/")[0])
    r = _open(f"redis://{_listen_elsewhere(monkeypatch, port)}/0")
    assert r.put(SOC, KEY, *_entry()) > 0
    assert r.get(SOC, KEY) is not None
    r.close()


@pytest.mark.parametrize("scheme", ["rediss", "rediss+cluster"])
def test_a_tls_remote_still_speaks_tls_over_the_bounded_connect(
    scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The TLS connection's class wraps the bounded connect's socket, never sends in
    the clear: the server's first bytes are a TLS ClientHello (which it cannot answer)."""
    first: list[bytes] = []

    def answer(conn: socket.socket, ended: threading.Event) -> None:
        first.append(conn.recv(5))

    with fake_server(answer) as port:
        hostport = _listen_elsewhere(monkeypatch, port)
        url = f"{scheme}://{hostport}?ssl_cert_reqs=none"
        settings = resolve_settings(remote={"url": url}, environ={"HOME": "/x"})
        got = _within(10, lambda: open_remote(settings.remote).get(SOC, KEY))
    assert isinstance(got, RemoteError), got
    assert first and first[0][:2] == b"\x16\x03", first  # a TLS handshake record


@pytest.mark.parametrize(
    ("get", "mget", "one", "two"),
    [
        (b":5\r\n", b"*2\r\n:5\r\n:6\r\n", RemoteCorrupt, RemoteCorrupt),
        (b"*0\r\n", b":5\r\n", RemoteCorrupt, RemoteError),
    ],
    ids=["numbers", "no-list"],
)
def test_an_answer_that_is_no_value_is_a_corrupt_value_or_a_remote_error(
    get: bytes, mget: bytes, one: type, two: type
) -> None:
    """A GET answered with a number was a TypeError out of the value's checks: not a
    remote's failure, so the warning named no remote."""

    def reply(words: list[bytes]) -> bytes | None:
        return {b"GET": get, b"MGET": mget}.get(words[0].upper())

    with fake_redis(reply) as port:
        r = _open(f"redis://127.0.0.1:{port}/0")
        with pytest.raises(RemoteCorrupt, match="not a value"):
            r.get(SOC, KEY)
        assert isinstance(r.get_many(SOC, [KEY])[KEY], one)
        if two is RemoteError:
            with pytest.raises(RemoteError, match=f"127.0.0.1:{port}"):
                r.get_many(SOC, [KEY, "f" * 32])
        else:
            assert all(isinstance(v, two) for v in r.get_many(SOC, [KEY, "f" * 32]).values())
        r.close()


def test_a_short_password_is_masked_where_quoted_not_in_every_word() -> None:
    """Every "e" of a message was masked for the password "e": the words mangled
    ("Conn***ction r***fus***d"), and where the masks fell said what it was."""
    from opcache.storage.remote import said

    secrets = frozenset({"e"})
    assert said(OSError("Connection refused"), secrets) == "Connection refused"
    quoted = "unknown command `AUTH`, with args beginning with: `e`, "
    assert said(Exception(quoted), secrets) == (
        "unknown command `AUTH`, with args beginning with: `***`, "
    )


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_a_value_over_this_client_s_cap_among_others_is_corrupt_not_a_remote_error(
    started, scheme
) -> None:
    """Another client with a bigger cap stored a 12 MB entry: a poll of it among others
    (an MGET) went past the answer's room and was a remote error, which pauses the
    remote for every key, and the value was never stored over."""
    server = started(*(_CLUSTER_ARGS if scheme == "redis+cluster" else ()))
    url = _one_node_clusters([server])[0] if scheme == "redis+cluster" else server.url
    small = "fedcba9876543210" * 2
    big_files = {"k.o": b"\x7fELF" + os.urandom(12 << 20)}  # (past 8 MiB of slack too)
    big = open_remote(
        resolve_settings(remote={"url": url, "max_entry_mb": 16}, environ={"HOME": "/x"}).remote
    )
    big.put(SOC, KEY, make_manifest(KEY, big_files, 1.0, {"op_type": "Add"}, 1000.0), big_files)
    _, files = _entry()
    big.put(SOC, small, make_manifest(small, files, 1.0, {"op_type": "Add"}, 1000.0), files)
    mine = open_remote(
        resolve_settings(remote={"url": url, "max_entry_mb": 1}, environ={"HOME": "/x"}).remote
    )
    found, _claimed = mine.watch(SOC, [KEY, small])
    assert isinstance(found[KEY], RemoteCorrupt) and found[KEY].maybe_sound
    assert found[small][0].files == files
    big.close()
    mine.close()


@pytest.mark.parametrize("many", [False, True])
def test_a_claim_s_name_holding_another_program_s_key_is_compiled_unclaimed(
    tmp_path: Path, redis_url: str, redis_server, caplog, many: bool
) -> None:
    """A hash (another program's, or a proxy that answers no claim) at a key's claim
    name: SET NX refused the claim, and MGET, which reads no hash, found none held,
    so the compile waited for a holder that never was until lock_timeout (600 s)."""
    settings = machine(tmp_path, "a", redis_url)
    requests = [make_request(0), make_request(1)]
    with opcache.OpCache(settings) as cache:
        keys = [cache.explain(r, ToyCompiler(tmp_path / "calls")).key for r in requests]
    for key in keys:
        redis_server.client().hset(f"opcache:1:{SOC}:{key}:claim", "f", "v")
    done: list = []

    def compile_them() -> None:
        with opcache.OpCache(settings) as cache:
            compiler = ToyCompiler(tmp_path / "calls")
            if many:
                outs = [tmp_path / "o" / str(n) for n in range(2)]
                done.extend(cache.compile_many(requests, compiler, outs))
            else:
                done.append(cache.compile(requests[0], compiler, tmp_path / "o" / "0"))

    with caplog.at_level(logging.WARNING, logger="opcache"):
        worker = threading.Thread(target=compile_them, daemon=True)
        worker.start()
        worker.join(60)
    assert done, "the compile still waits for a claim no one holds after 60 s"
    assert [r.status for r in done] == ["miss"] * len(done)
    assert "yet no look finds one held" in caplog.text


def test_a_server_that_names_no_eviction_policy_is_reported_as_none() -> None:
    """(not as the text "None", which `remote stats` printed as a policy, with its
    warning that the server never evicts)"""
    from opcache.storage.redis import memory_of

    assert memory_of([{"used_memory": 5}])["maxmemory_policy"] is None
    assert memory_of([{"maxmemory_policy": "allkeys-lru"}])["maxmemory_policy"] == "allkeys-lru"
