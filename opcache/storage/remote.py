"""What a remote kind is: the ``Remote`` base class and its defaults, the claims,
the errors, and ``connect``, which opens one kind by its URL scheme.

Every kind (``redis.py``, ``folder.py``...) imports from here, never from the
package, which opens tiers of them (``tiers.py``) and loads this module only
with the first remote.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import socket
import time

from .._log import get_logger
from ..settings import MB, REMOTE_KINDS

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..settings import RemoteSettings
    from .entry import Entry
    from .local import LocalStore

    # A value fetched and checked: (the entry, its manifest's bytes, the value's
    # size on the wire, which is what ``remote_bytes_down`` counts).
    Fetched = tuple[Entry, bytes, int]


log = get_logger(__name__)

# A failing remote is left alone this long, doubled at each failure in a row.
FIRST_PAUSE = 10.0
LAST_PAUSE = 300.0
_PAUSE_NOTE = "remote-pause-"  # + a digest of the URL
_NOTE_FRESH_SECONDS = 1.0  # how long another process's pause note is taken as read

# Bytes a second an answer moves at least: one may take the timeout plus a second
# per MiB of it (a big entry on a slow link), never longer.
MIN_RATE = 1 << 20


class Backoff:
    """How long a failing remote is left alone: ``FIRST_PAUSE`` after a failure,
    doubled up to ``LAST_PAUSE`` while failures go on, the first again after a
    success.  The first failure is a warning, the later ones debug lines (a
    build of thousands of compiles says it once).

    With ``notes`` (the cache folder's bookkeeping), a pause is written there too,
    under a digest of ``url`` (as shown: never its password), and one another
    process wrote is kept: the short processes of a build (``opcache wrap``, one
    per compile command) skip a dead server instead of each waiting for it, while
    a corrected URL is tried at once.
    """

    def __init__(self, what: str, notes: LocalStore | None = None, url: str = "") -> None:
        self.what = what  # "the remote cache", "the remote tier <url>"
        self.until = 0.0  # time.time() until which the remote is not asked
        self._pause = FIRST_PAUSE
        self._warned = False
        self._notes = notes
        self._note = _PAUSE_NOTE + hashlib.sha256(url.encode()).hexdigest()[:16]
        self._noted, self._noted_at = 0.0, -_NOTE_FRESH_SECONDS  # another process's pause

    def paused(self) -> bool:
        """Whether the remote is not to be asked now (paused here or by another process).

        A pause that ends further ahead than ``LAST_PAUSE`` is no pause: it was
        written by a host whose clock runs ahead (a cache folder shared between
        hosts), or before this clock stepped back, and would keep the remote
        unused for hours."""
        now = time.time()
        return any(now < until <= now + LAST_PAUSE for until in (self.until, self._noted_until()))

    def failed(self, error: object) -> float:
        """Pause after ``error``; returns until when."""
        self.until = time.time() + self._pause
        message = f"{self.what} is not used for {self._pause:.0f} s: {error}"
        self._pause = min(self._pause * 2, LAST_PAUSE)
        (log.debug if self._warned else log.warning)("%s", message)
        self._warned = True
        if self._notes is not None:
            try:
                self._notes.write_note(f"{self.until:.3f}".encode(), self._note)
            except OSError as e:
                log.debug("cannot record the pause of %s: %s", self.what, e)
        return self.until

    def recovered(self) -> None:
        self._pause = FIRST_PAUSE

    def _noted_until(self) -> float:
        """Until when another process found the remote failing (0.0: it did not)."""
        if self.until or self._notes is None:
            return 0.0  # this process has its own record, and tried again since
        now = time.monotonic()
        if now - self._noted_at >= _NOTE_FRESH_SECONDS:  # a file read, not one per call
            note = self._notes.read_note(self._note)
            try:
                self._noted = float(note) if note else 0.0
            except ValueError:
                self._noted = 0.0
            self._noted_at = now
        return self._noted


# Characters of a message that says what a server or a client library said: a
# server chooses that text, and may make it as long as it likes.
_SAID_CHARACTERS = 300
_MESSAGE_CHARACTERS = 1000
_SECRET_HEAD = 8  # characters of a password that, followed by more of it, are masked
# How servers and URLs quote what they were sent: a short password is masked there only.
_QUOTES = (("`", "`"), ("'", "'"), ('"', '"'), (":", "@"), ("=", "&"), ("=", " "))


class RemoteError(Exception):
    """The remote failed: down, too slow, refused the credentials or a command.

    A remote raises nothing else for a failure of its server, network or client
    library (the cache still treats anything else as one, never failing a compile).
    Its message goes to the terminal, in a warning or an ``opcache: error:`` line,
    so it is made fit for one here, whichever kind raised it: each control
    character escaped (a server's ``\x1b[2J`` cleared the screen, its ``\r``
    wrote a line of its own over ours), at most ``_MESSAGE_CHARACTERS``.
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(printable(message, _MESSAGE_CHARACTERS))


def printable(text: str, most: int) -> str:
    """``text`` with each character a terminal would act on escaped as ``repr`` escapes
    it, and cut to ``most`` characters.

    (Not ``errors.shown``, a setting's value quoted and cut at 80: a TLS error's
    reason comes past that.)
    """
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(text) > most:
        text = f"{text[: most - 40]}... ({len(text)} characters)"
    return text


def said(error: object, secrets: frozenset[str]) -> str:
    """What a server or a client library said (an exception's text) for a message:
    each of ``secrets`` masked, then escaped and cut short by ``printable``.

    A server quotes the commands it refuses, passwords and all (Redis without
    HELLO: "unknown command `HELLO`, with args beginning with: `3`, `AUTH`,
    `default`, `<password>`"), and cuts what it quotes (Redis at 128
    characters): a secret's first ``_SECRET_HEAD`` characters, and as much of
    the rest as follows them, are masked; a shorter secret only where quoted.
    """
    text = str(error) or type(error).__name__
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) < _SECRET_HEAD:
            # A short one matches words by chance ("e" in "refused"): masked each time,
            # the words were mangled and the masks showed it.  Only as a server or a
            # URL quotes it.
            for left, right in _QUOTES:
                text = text.replace(f"{left}{secret}{right}", f"{left}***{right}")
            continue
        head = secret[:_SECRET_HEAD]
        at = text.find(head)
        while at >= 0:
            end = at + len(head)
            while end - at < len(secret) and text[end : end + 1] == secret[end - at]:
                end += 1
            text = f"{text[:at]}***{text[end:]}"
            at = text.find(head, at + 3)
    return printable(text, _SAID_CHARACTERS)


def secrets_of(settings: RemoteSettings, *more: str) -> frozenset[str]:
    """The remote's password in each form a message may quote it in: as set, as its
    URL writes it (percent-encoded) and decoded, and percent-encoded; and ``more``."""
    from urllib.parse import quote, unquote, urlsplit

    given = [settings.password or "", *more]
    for url in settings.url.split(" "):
        with contextlib.suppress(ValueError):  # (a URL the settings' checks refuse)
            given.append(urlsplit(url).password or "")
    forms = set()
    for secret in given:
        forms.update((secret, unquote(secret), quote(secret, safe=""), quote(secret)))
    return frozenset(form for form in forms if form)


def connect_in_turn(
    found: Iterable[tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple]],
    deadline: float,
    timeout: float | None,
) -> socket.socket:
    """A socket connected to the first of ``found`` (a host's addresses, as
    ``socket.getaddrinfo`` answers) that answers by ``deadline`` (``time.monotonic``'s),
    each tried in turn with the time left; then given ``timeout`` for each read and
    write.

    ``socket.create_connection`` (http.client's) and redis-py's own connect give
    each address the whole connect timeout: a name with three unreachable addresses
    (a blackholed AAAA) held an HTTP request three times its timeout, and a name with
    40 a Redis connect 40 times its half second.  The look-up is the caller's, the
    system resolver's: nothing here bounds it.
    """
    error: OSError = TimeoutError("no address of the host answered within the timeout")
    for family, kind, proto, _, where in found:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(where)
        except OSError as e:
            sock.close()
            error = e
            continue
        sock.settimeout(timeout)
        return sock
    raise error


class RemoteCorrupt(Exception):
    """A value fetched from the remote is not a whole, valid entry of its key.

    ``maybe_sound``: it may be sound to another opcache sharing the remote (a value
    of another format, or over this one's size cap): never this one's to delete."""

    size = 0  # the value's bytes on the wire

    def __init__(self, message: str, *, maybe_sound: bool = False) -> None:
        super().__init__(message)
        self.maybe_sound = maybe_sound


class Claim:
    """A key taken for one compile in the cluster, until ``release`` or ``stored``.

    ``owned`` is False for a claim that could not be taken but need not be
    waited for (a read-only client, a remote with no claims, one that is
    down, a key whose last compile failed): the compile goes on unclaimed.
    This base class is that unowned claim; a kind with claims subclasses it
    with ``owned`` True.
    """

    owned = False
    # Unowned as the key's last compile, elsewhere, failed a moment ago: the clients
    # waiting for it compile it side by side, and so may this one's own waiters
    # (a local lock held for the key can go before the compile, as after a local
    # failure).
    failed_before = False
    # Whether ``stored`` leaves the key refused to other claims for the claim's
    # seconds: then a client that looked at it less than that ago and wins a
    # claim need not look again (the entry cannot have come meanwhile).
    marks_stored = False

    def release(self) -> None:
        """Let the key go, its entry not stored (the compile failed, or its entry was
        not sent): a kind that can tells the clients waiting for it to compile it at
        once, each unclaimed, as a local lock's waiters do (a holder that died lets
        its claim expire instead: then one client takes the key over).  A second
        call does nothing."""

    def stored(self) -> None:
        """Let the key go, its entry stored in the remote: a kind that can, tells a
        client claiming it now to fetch it rather than compile it again."""
        self.release()


UNCLAIMED = Claim()


class Remote:
    """One kind of remote tier.  A new kind subclasses this and provides:

    - ``get_many``: the entries of some keys of a chip, each checked as
      ``entry.py`` checks a local read (``RemoteCorrupt`` for a bad value);
    - ``put``: store one entry (the manifest's bytes and the files);
    - a module function ``connect(settings)`` that returns the instance.

    Everything else has a default a kind may override: ``get`` and
    ``have_many`` (which keys are there) ask ``get_many``, ``put_many`` asks
    ``put`` for each entry; with no ``claim`` every client compiles the keys
    it misses (no single flight across machines); ``watch`` is ``get_many``
    with no claims; ``discard``, ``usage`` and ``clear`` (``opcache remote``) raise
    ``RemoteError`` ("not supported"); ``close`` does nothing.  Every method
    raises ``RemoteError`` for a failure of the server or the network.

    ``read_only`` (a client that never writes), ``max_entry_bytes`` (the
    largest entry ``put`` sends), ``where`` (the URL with its password
    masked, for messages) and ``secrets`` (the password's forms: a message
    quoting what a server or a library said passes it through ``said``) come
    from the settings.
    """

    def __init__(self, settings: RemoteSettings) -> None:
        self.read_only = settings.read_only
        self.max_entry_bytes = settings.max_entry_mb * MB
        self.where = settings.shown_url
        self.secrets = secrets_of(settings)  # (masked in whatever a message quotes: ``said``)

    # -- what every kind provides ------------------------------------------------------

    def get_many(self, soc: str, keys: list[str]) -> dict[str, Fetched | RemoteCorrupt]:
        """The entries of ``keys`` that are there, by key, in few round trips
        (a bad value as its RemoteCorrupt, with its ``size``)."""
        raise NotImplementedError

    def put(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        """Store an entry; returns the bytes sent (0 when it was not sent: read-only,
        over ``max_entry_bytes``)."""
        raise NotImplementedError

    # -- what a kind may add -------------------------------------------------------------

    def put_many(self, soc: str, entries: list[tuple[str, bytes, dict[str, bytes]]]) -> list[int]:
        """Store several entries (key, manifest's bytes, files); the bytes sent for each
        (0: not sent).  By default one ``put`` each; a kind that can send them in
        one round trip says so."""
        return [self.put(soc, key, manifest, files) for key, manifest, files in entries]

    def replace(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        """Store a value that changes (the index of ``opcache cann``), over the one there;
        the bytes sent (0: not taken, and the value there left as it was).  By
        default ``put``, and when that kept another value (a kind that keeps a key's
        first value), that one dropped and ``put`` again; a kind whose ``put`` says
        0 without trying when the key is there writes over it instead."""
        if self.read_only or len(manifest) + sum(map(len, files.values())) > self.max_entry_bytes:
            return 0
        sent = self.put(soc, key, manifest, files)
        if sent or key not in self.have_many(soc, [key]):
            return sent  # (refused: nothing there to drop)
        self.discard(soc, key)
        return self.put(soc, key, manifest, files)

    def put_claimed(
        self, soc: str, key: str, manifest: bytes, files: dict[str, bytes], claim: Claim | None
    ) -> int:
        """``put``, then, once sent, ``claim.stored()``; a kind that can do both in
        one round trip says so."""
        sent = self.put(soc, key, manifest, files)
        if sent and claim is not None:
            claim.stored()
        return sent

    def have_many(self, soc: str, keys: list[str]) -> set[str]:
        """Which of ``keys`` the remote holds, in few round trips.  By default the
        entries are fetched; a kind that can ask for existence alone says so."""
        return set(self.get_many(soc, keys))

    def get(self, soc: str, key: str) -> tuple[Entry, bytes] | None:
        """(the checked entry, its manifest's bytes), or None when absent."""
        got = self.get_many(soc, [key]).get(key)
        if got is None:
            return None
        if isinstance(got, RemoteCorrupt):
            raise got
        return got[0], got[1]

    def claim(self, soc: str, key: str, seconds: float) -> Claim | None:
        """The key for one compile in the cluster, or None when another client
        holds it (or its compile just failed, until a look, ``watch`` or
        ``peek_claims``, saw that: then an unowned claim).  A claim lasts
        ``seconds`` past its holder's death.  By default there are no claims:
        the compile goes on unclaimed."""
        return UNCLAIMED

    def claimed(self, soc: str, key: str) -> bool:
        """Whether a claim on ``key`` is held."""
        return False

    def watch(
        self, soc: str, keys: list[str]
    ) -> tuple[dict[str, Fetched | RemoteCorrupt], set[str]]:
        """(``get_many``'s answer, the keys a claim is held on), in one round trip:
        how a client waits for keys others compile.  A key whose compile just
        failed is held by no claim."""
        return self.get_many(soc, keys), set()

    def discard(self, soc: str, key: str) -> None:
        """Drop one entry."""
        raise RemoteError(f"{self.where}: removing an entry is not supported")

    def usage(self, soc: str | None = None) -> dict[str, object]:
        """``opcache remote stats``: {"chips": {soc: {"entries", "bytes"}}, and what
        the server says of its memory}."""
        raise RemoteError(f"{self.where}: stats are not supported for this kind of remote")

    def clear(self, soc: str | None = None) -> int:
        """``opcache remote clear``: delete this cache's entries (of one chip), never
        another's; returns how many."""
        raise RemoteError(f"{self.where}: clearing is not supported for this kind of remote")

    def warm_up(self) -> None:
        """Make the first connection now, before any compile needs it (a kind with
        connections says so)."""

    def peek_claims(self, soc: str, keys: list[str]) -> set[str]:
        """Which of ``keys`` a claim is held on (or their entry was just stored), in
        one round trip: keys not worth a claim of their own.  By default none."""
        return set()

    def close(self) -> None:
        """Let go of connections and claims; the remote is not used after."""


def connect(settings: RemoteSettings) -> Remote:
    """The remote of one URL: its kind's module (``REMOTE_KINDS``) connects it
    (RemoteError when its client library is missing)."""
    scheme = settings.url.partition(":")[0]
    module = importlib.import_module(f".{REMOTE_KINDS[scheme]}", __package__)
    return module.connect(settings)
