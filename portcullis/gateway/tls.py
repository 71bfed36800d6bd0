"""TLS on the gateway's public port: vLLM's flags, certificates that follow renewals, mTLS names.

The listening context checks the certificate files at each new connection's handshake (a
`stat` of each) and, when they changed, moves that handshake and every later one to a context
built from the new files. Connections already open keep the context they began with, so a
renewal (cert-manager, certbot, a mounted Secret) needs no restart and drops nothing.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from functools import partial
from typing import Any

import structlog

log = structlog.get_logger("portcullis.gateway.tls")

CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}  # uvicorn's and vLLM's numbers
# One year, as browsers' preload lists ask; no includeSubDomains: the gateway speaks for its own host only.
HSTS_HEADER = ("strict-transport-security", "max-age=31536000")
CLIENT_CERT_KEY = "portcullis.client_cert"  # in a request's scope: the verified client certificate's names


@dataclass(frozen=True)
class TLSFiles:
    """What the TLS flags name; picklable, so uvicorn's worker processes build their own context."""

    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0

    def build(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.certfile, self.keyfile)
        context.verify_mode = CERT_REQS[self.cert_reqs]
        if self.ca_certs:
            context.load_verify_locations(self.ca_certs)
        context.set_alpn_protocols(["http/1.1"])  # uvicorn's h11 stack speaks no HTTP/2
        return context

    def stamp(self) -> tuple[tuple[int, int, int], ...]:
        """Changes whenever any of the files is rewritten or its link swapped (Kubernetes)."""
        stamps = []
        for path in (self.certfile, self.keyfile, self.ca_certs):
            if path:
                try:
                    info = os.stat(path)
                    stamps.append((info.st_mtime_ns, info.st_size, info.st_ino))
                except OSError:
                    stamps.append((0, 0, 0))  # mid-swap: looked at again at the next handshake
        return tuple(stamps)


class ReloadingContext:
    """The listening `SSLContext`, whose handshakes switch to a fresh context after a renewal.

    A renewal written in two steps (certificate, then key) fails to load in between: the
    context in use stays, and the next change of the files is tried again.
    """

    def __init__(self, files: TLSFiles) -> None:
        self.files = files
        self.seen = files.stamp()
        self.current = self.listening = files.build()
        self.listening.sni_callback = self._hello  # called at every ClientHello, SNI or not

    def _hello(self, connection: Any, server_name: str | None, context: ssl.SSLContext) -> None:
        stamp = self.files.stamp()
        if stamp != self.seen:
            self.seen = stamp
            self._reload()
        if self.current is not context:
            connection.context = self.current

    def _reload(self) -> None:
        try:
            self.current = self.files.build()
        except (OSError, ssl.SSLError) as exc:
            log.warning("tls_reload_failed", certfile=self.files.certfile, error=str(exc),
                        hint="the previous certificate keeps serving; the files are read again when they change")
            return
        log.info("tls_reloaded", certfile=self.files.certfile)


def context_factory(files: TLSFiles, config: Any, default: Any) -> ssl.SSLContext:
    """uvicorn's `ssl_context_factory` (run in each worker): the reloading context."""
    return ReloadingContext(files).listening


def uvicorn_tls_options(settings: Any) -> dict[str, Any]:
    """uvicorn options for the settings' TLS (none without a certificate), HSTS included."""
    files = tls_files(settings)
    if files is None:
        return {}
    return dict(ssl_certfile=files.certfile, ssl_keyfile=files.keyfile, ssl_ca_certs=files.ca_certs,
                ssl_cert_reqs=CERT_REQS[files.cert_reqs], ssl_context_factory=partial(context_factory, files),
                headers=[HSTS_HEADER])


def tls_files(settings: Any) -> TLSFiles | None:
    if settings.ssl_certfile is None:
        return None
    return TLSFiles(str(settings.ssl_certfile), _text(settings.ssl_keyfile), _text(settings.ssl_ca_certs),
                    settings.ssl_cert_reqs)


def _text(path: Any) -> str | None:
    return None if path is None else str(path)


def tls_problem(settings: Any) -> str | None:
    """Why the TLS files cannot serve (a key that does not match, a bundle that is not PEM), at start."""
    files = tls_files(settings)
    if files is None:
        return None
    try:
        files.build()
    except (OSError, ssl.SSLError) as exc:
        return (f"cannot use the TLS files (--ssl-certfile {files.certfile}, --ssl-keyfile {files.keyfile}, "
                f"--ssl-ca-certs {files.ca_certs}): {exc}; give a PEM certificate chain, its matching "
                "private key and a PEM CA bundle")
    return None


def client_cert_names(peercert: dict[str, Any] | None) -> tuple[str, ...]:
    """A verified client certificate's names: its DNS, URI and email subject alternative names, or,
    only when it has no subject alternative name at all, its subject's common name.

    A CA that checks the SANs it signs may still copy a requested CN unchecked, so a CN is never
    read beside SANs (RFC 6125 6.4.4). Python reports a peer certificate only once it verified
    against --ssl-ca-certs.
    """
    if not peercert:
        return ()
    alt_names = peercert.get("subjectAltName", ())
    if alt_names:
        return tuple(value for kind, value in alt_names if kind in ("DNS", "URI", "email"))
    return tuple(value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName")


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's TLS flags, shared by `portcullis gateway` and `portcullis serve`."""
    parser.add_argument("--ssl-certfile", help="PEM certificate chain: serve HTTPS (with HSTS); a renewed file "
                        "is used from the next connection on, without a restart")
    parser.add_argument("--ssl-keyfile", help="PEM private key of --ssl-certfile (if not in that file)")
    parser.add_argument("--ssl-ca-certs", help="PEM bundle of the CAs whose client certificates are verified (mTLS)")
    parser.add_argument("--ssl-cert-reqs", type=int, choices=sorted(CERT_REQS), default=0,
                        help="client certificates: 0 not asked (default), 1 optional, 2 required; "
                        "a verified one can authenticate through the policy's client_certs")


def tls_argv(args: argparse.Namespace) -> list[str]:
    """The TLS flags as given, for a child `portcullis gateway`."""
    argv = []
    for flag in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
        value = getattr(args, flag)
        if value:
            argv += ["--" + flag.replace("_", "-"), os.path.abspath(value)]
    if args.ssl_cert_reqs:
        argv += ["--ssl-cert-reqs", str(args.ssl_cert_reqs)]
    return argv
