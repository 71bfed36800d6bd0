"""`GatewaySettings`: how one gateway process starts, validated before it binds a port.

Unsafe values are refused here, at start-up, with a message that says what to change.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator

from portcullis.gateway.syslog import parse_syslog_url
from portcullis.protocol.channel import DEFAULT_ENGINE_URL, MIN_ENGINE_TOKEN_CHARS


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    policy: Path
    engine_url: str = DEFAULT_ENGINE_URL
    engine_token: SecretStr
    workers: int = Field(1, ge=1, le=64)
    reload_interval_s: float = Field(0.5, gt=0, le=2.0, description="hot reload must land within 2 s")
    engine_read_timeout_s: float = Field(600.0, gt=0)
    audit_keyring: Path | None = Field(
        None, description="the audit keyring (gateway.audit.keys), outside the audit log's folder; "
        "default $PORTCULLIS_AUDIT_KEYRING, else secrets/audit-keyring.json beside the policy; "
        "created (0600) on first start")
    audit_checkpoint_lines: int = Field(1000, ge=1, le=1_000_000, description="a signed checkpoint every N lines")
    audit_checkpoint_interval_s: float = Field(60.0, gt=0, le=3600,
                                               description="...or this long after the first unsigned line")
    # The policy's upstreams (gateway.upstream.fleet): how often each is checked and scraped.
    upstream_health_interval_s: float = Field(2.0, gt=0, le=60, description="each replica's /health")
    upstream_scrape_interval_s: float = Field(0.5, gt=0, le=10, description="each replica's vllm:* gauges")
    forwarded_allow_ips: str | None = Field(
        None, description="trusted proxies whose X-Forwarded-For gives the client address")
    # Client connections (gateway/connection.py). The upper bounds keep a typo from undoing
    # the defence: a client may hold a connection only this long without progress.
    timeout_header_s: float = Field(10.0, gt=0, le=60, description="time to send a request head")
    timeout_body_s: float = Field(60.0, gt=0, le=600, description="time to send a request body")
    timeout_send_s: float = Field(30.0, gt=0, le=600, description="time a client may leave a response unread")
    timeout_keep_alive_s: float = Field(5.0, gt=0, le=300, description="idle time between requests")
    limit_concurrency: int = Field(1000, ge=1, le=100_000, description="connections or requests at once")
    h11_max_incomplete_event_size: int = Field(64 * 1024, ge=4 * 1024, le=1024 * 1024,
                                               description="largest request head, in bytes")
    # TLS on the public port (gateway.tls), with vLLM's flag names.
    ssl_certfile: Path | None = Field(None, description="PEM certificate chain; set = HTTPS with HSTS")
    ssl_keyfile: Path | None = Field(None, description="its private key, unless in the certificate file")
    ssl_ca_certs: Path | None = Field(None, description="CAs that client certificates are verified against")
    ssl_cert_reqs: int = Field(0, ge=0, le=2, validate_default=True,
                               description="client certificates: 0 none, 1 optional, 2 required")
    audit_syslog: str | None = Field(
        None, description="mirror audit lines to syslog (RFC 5424): udp://host:514 or unix:///dev/log (gateway.syslog)")
    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL of a collector, e.g. http://collector:4318/v1/traces (gateway.telemetry)")

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _no_wildcard_trust(cls, value: str | None) -> str | None:
        # Trusting every peer would let any client pick the address its failures count against.
        if value is not None and "*" in value:
            raise ValueError("forwarded_allow_ips must list the proxies' addresses, not '*'")
        if value is None:
            return value
        for entry in value.split(","):
            try:
                ipaddress.ip_network(entry.strip(), strict=False)
            except ValueError:
                # uvicorn would compare it as a plain string and silently trust no proxy at all.
                raise ValueError(f"{entry.strip()!r} is not an IP address or a network "
                                 "such as 10.0.0.0/8") from None
        return value

    @field_validator("ssl_certfile", "ssl_keyfile", "ssl_ca_certs")
    @classmethod
    def _tls_file_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"{path} does not exist or is not a file")
        return path

    @field_validator("ssl_cert_reqs")
    @classmethod
    def _tls_complete(cls, reqs: int, info: ValidationInfo) -> int:
        # The last TLS field: the others are in info.data unless they failed on their own.
        if "ssl_certfile" not in info.data or "ssl_ca_certs" not in info.data:
            return reqs
        given = reqs or info.data.get("ssl_keyfile") or info.data["ssl_ca_certs"]
        if info.data["ssl_certfile"] is None and given:
            raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile "
                             "(the gateway's own certificate)")
        if reqs and info.data["ssl_ca_certs"] is None:
            raise ValueError("--ssl-cert-reqs 1 or 2 verifies client certificates: give their CA bundle "
                             "with --ssl-ca-certs")
        return reqs

    @field_validator("audit_syslog")
    @classmethod
    def _syslog_address(cls, url: str | None) -> str | None:
        if url is not None:
            parse_syslog_url(url)
        return url

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp_url(cls, url: str | None) -> str | None:
        if url is not None and (urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname):
            raise ValueError(f"{url!r} is not an OTLP/HTTP URL such as http://collector:4318/v1/traces")
        return url

    @field_validator("engine_token")
    @classmethod
    def _strong_token(cls, token: SecretStr) -> SecretStr:
        if len(token.get_secret_value()) < MIN_ENGINE_TOKEN_CHARS:
            raise ValueError(f"the engine token must be at least {MIN_ENGINE_TOKEN_CHARS} characters")
        return token

    @field_validator("engine_url")
    @classmethod
    def _private_engine(cls, url: str) -> str:
        return check_engine_url(url)

    @field_validator("policy")
    @classmethod
    def _policy_exists(cls, path: Path) -> Path:
        if not path.is_file():
            raise ValueError(f"policy file {path} does not exist")
        return path


def check_engine_url(url: str) -> str:
    """An engine URL the private channel can use, normalised (`unix:/p` -> `unix:///p`), or ValueError."""
    if url.startswith("unix:"):
        path = url[len("unix://"):] if url.startswith("unix://") else url[len("unix:"):]
        if not path.startswith("/"):
            raise ValueError("unix:// engine URLs need an absolute socket path")
        return "unix://" + path
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        # No https: the channel is a private network or a socket, and the transport speaks
        # plain HTTP/1.1 (put a mesh or WireGuard underneath if the network is not trusted).
        raise ValueError("engine_url must be unix:///path/to/sock or http://host:port")
    if parts.username or parts.password or parts.query or parts.path not in ("", "/"):
        raise ValueError("engine_url must not carry credentials, a path or a query")
    _refuse_public_address(parts.hostname)
    return url


def _refuse_public_address(host: str) -> None:
    """The engine trusts whoever holds the internal token: keep that token off the internet."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return  # a name (a Compose or Kubernetes service): resolved on the private network
    if not (address.is_private or address.is_loopback):
        raise ValueError(f"engine address {host} is public; the engine must sit on a private network")
