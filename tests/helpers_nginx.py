"""A real nginx with WebDAV for the HTTP remote's tests: its own config, folder and port.

Not the system service: one ``nginx`` process (``master_process off``, so it
runs as the user who starts it) on a free loopback port, serving
``<folder>/data``, with ``PUT`` and ``DELETE`` (``dav_methods``).  Paths:

- ``/cache/``: open to anyone;
- ``/basic/``: basic auth, user ``ci`` password ``s3cret``;
- ``/token/``: a bearer token, ``Authorization: Bearer t0ken``;
- ``/ro/``: GET only (PUT answers 403), serving the same files as ``/cache/``;
- with openssl at hand, ``/cache/`` over TLS too (``tls_url``), on a certificate
  of its own (``certificate``) for 127.0.0.1.

The binary is ``$NGINX_BIN``, else ``nginx`` on PATH or in /usr/sbin; without
one, the tests that need it are skipped saying how to get it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from helpers_cache import SOC
from helpers_redis import ServerProcess, free_port

HOW_TO_GET_ONE = "no nginx: apt-get install nginx (the tests start their own), or set NGINX_BIN"
BASIC = ("ci", "s3cret")
TOKEN = "t0ken"

_CONFIG = """
daemon off;
master_process off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log;
events {{ worker_connections 128; }}
http {{
    access_log off;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    client_max_body_size 0;
    keepalive_requests 10000;
    server {{
        listen 127.0.0.1:{port};
        root {folder}/data;
        location /cache/ {{
            dav_methods PUT DELETE;
            create_full_put_path on;
        }}
        location /basic/ {{
            auth_basic "opcache";
            auth_basic_user_file {folder}/htpasswd;
            dav_methods PUT DELETE;
            create_full_put_path on;
        }}
        location /token/ {{
            if ($http_authorization != "Bearer {token}") {{ return 401; }}
            dav_methods PUT DELETE;
            create_full_put_path on;
        }}
        location /small/ {{
            client_max_body_size 1k;
            dav_methods PUT DELETE;
            create_full_put_path on;
        }}
        location /ro/ {{
            alias {folder}/data/cache/;
            limit_except GET HEAD {{ deny all; }}
        }}
    }}
{tls}
}}
"""
# With openssl at hand: the same /cache/ over TLS, its certificate self-signed for 127.0.0.1.
_TLS = """
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {folder}/cert.pem;
        ssl_certificate_key {folder}/key.pem;
        root {folder}/data;
        location /cache/ {{
            dav_methods PUT DELETE;
            create_full_put_path on;
        }}
    }}
"""


def _self_signed(folder: Path) -> bool:
    """A certificate and key for 127.0.0.1 in ``folder``; False without openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return False
    argv = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
    argv += ["-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")]
    argv += ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0


def find_nginx() -> str | None:
    for candidate in (os.environ.get("NGINX_BIN"), shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


class Nginx(ServerProcess):
    """One nginx process; ``stop`` and ``start`` keep its port and files."""

    def __init__(self, binary: str, folder: Path) -> None:
        super().__init__(binary, folder)
        (folder / "data" / "cache").mkdir(parents=True, exist_ok=True)
        (folder / "htpasswd").write_text(f"{BASIC[0]}:{{PLAIN}}{BASIC[1]}\n")
        self.tls_port = free_port() if _self_signed(folder) else None
        tls = _TLS.format(folder=folder, port=self.tls_port) if self.tls_port else ""
        config = _CONFIG.format(folder=folder, port=self.port, token=TOKEN, tls=tls)
        (folder / "nginx.conf").write_text(config)

    @property
    def certificate(self) -> Path:
        """The TLS server's certificate (its own CA)."""
        return self.folder / "cert.pem"

    def tls_url(self) -> str:
        return f"https://127.0.0.1:{self.tls_port}/cache"

    def url(self, path: str = "cache") -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    @property
    def data(self) -> Path:
        """Where ``/cache/`` keeps its files."""
        return self.folder / "data" / "cache"

    def object_path(self, key: str, soc: str = SOC) -> Path:
        """Where ``/cache/`` keeps the entry ``key`` (bazel-remote's ac/ layout, the
        default prefix)."""
        return self.data / "ac" / hashlib.sha256(f"opcache:1:{soc}:{key}".encode()).hexdigest()

    def start(self) -> None:
        argv = [self.binary, "-p", str(self.folder), "-c", str(self.folder / "nginx.conf")]
        argv += ["-e", str(self.folder / "error.log")]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                error = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"nginx exited with {self.proc.returncode}: {error}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("nginx did not listen within 10 s")

    def stop(self) -> None:
        self.kill()  # nothing of nginx's needs a clean stop: its files are the test's
