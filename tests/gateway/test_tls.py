"""TLS on the gateway's port: the openai SDK over HTTPS, a wrong CA refused, HSTS, mTLS
principals, and a renewed certificate picked up by the next connection while open ones go on.

The gateway runs as `portcullis gateway` builds it (the uvicorn options the CLI passes,
guarded h11 protocol included), with a CA and certificates made here with `cryptography`.
"""

from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import json
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from portcullis import cli
from portcullis.gateway.connection import GuardedH11Protocol

from .conftest import ENGINE_TOKEN, RunningGateway, base_policy, write_policy_file

# ---- a test CA ---------------------------------------------------------------------------


@dataclass
class Issued:
    cert: x509.Certificate
    key: Any

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())

    def write(self, folder: Path, name: str) -> tuple[Path, Path]:
        cert, key = folder / f"{name}.pem", folder / f"{name}.key"
        _replace(cert, self.pem())
        _replace(key, self.key_pem())
        return cert, key


def _replace(path: Path, data: bytes) -> None:
    """As a renewal tool writes: a new file moved over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class CertAuthority:
    def __init__(self, name: str = "Portcullis Test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (self._builder(subject, self.key.public_key())
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.issued = Issued(self.cert, self.key)

    def _builder(self, subject: x509.Name, public_key: Any) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.timezone.utc)
        issuer = self.cert.subject if hasattr(self, "cert") else subject
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    def issue(self, common_name: str, dns: tuple[str, ...] = (), ip: tuple[str, ...] = ()) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ip]
        builder = self._builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), key.public_key())
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return Issued(builder.sign(self.key, hashes.SHA256()), key)

    def client_context(self, client: Issued | None = None, folder: Path | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=self.issued.pem().decode())
        if client is not None:
            assert folder is not None
            cert, key = client.write(folder, "client")
            context.load_cert_chain(cert, key)
        return context


@pytest.fixture(scope="module")
def ca() -> CertAuthority:
    return CertAuthority()


# ---- a gateway started the way `portcullis gateway` starts it ------------------------------


def _start(tmp_path: Path, gateways: Any, policy: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
           *flags: str) -> RunningGateway:
    """Run `portcullis gateway ... FLAGS` up to uvicorn.run, then serve what it built on a free port."""
    folder = tmp_path / "gw"
    folder.mkdir(exist_ok=True)
    keys = gateways._write_keys(folder)
    (folder / "jwks.json").write_text(json.dumps(gateways.jwt_keys.jwks()))
    write_policy_file(folder / "policy.yaml", policy)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw, app=app))
    monkeypatch.setenv("PORTCULLIS_ENGINE_TOKEN", ENGINE_TOKEN)
    code = cli.main(["gateway", "--policy", str(folder / "policy.yaml"), "--engine-url",
                     f"unix://{gateways.stub.socket}", *flags])
    assert code == 0
    app = seen.pop("app")
    seen.update(port=0, timeout_graceful_shutdown=1, lifespan="on")
    server = uvicorn.Server(uvicorn.Config(app, **seen))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the gateway did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    running = RunningGateway(f"https://127.0.0.1:{port}", folder, app, _Stopper(server, thread), keys, policy)
    gateways.running.append(running)
    return running


@dataclass
class _Stopper:
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def server_cert(ca: CertAuthority, tmp_path: Path) -> tuple[Path, Path]:
    return ca.issue("gateway.test", dns=("localhost",), ip=("127.0.0.1",)).write(tmp_path, "server")


def _tls_flags(server_cert: tuple[Path, Path], *extra: str) -> list[str]:
    return ["--ssl-certfile", str(server_cert[0]), "--ssl-keyfile", str(server_cert[1]), *extra]


# ---- HTTPS with the openai SDK -------------------------------------------------------------


def test_openai_sdk_over_https_with_the_test_ca(ca, server_cert, gateways, tmp_path, monkeypatch):
    gw = _start(tmp_path, gateways, base_policy(), monkeypatch, *_tls_flags(server_cert))
    http_client = httpx.Client(verify=ca.client_context())
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.keys["alice"], http_client=http_client, max_retries=0)
    raw = client.completions.with_raw_response.create(model="demo", prompt="def add(a, b):", max_tokens=4)
    completion = raw.parse()
    assert completion.choices[0].text and completion.usage.completion_tokens > 0
    assert raw.headers["strict-transport-security"] == "max-age=31536000"
    # The guarded h11 protocol serves under TLS too (its limits and refusals stay in force).
    assert gw.server.server.config.http.func is GuardedH11Protocol
    records = asyncio.run(gw.wait_audit(1))  # a line lands just after its response went out
    assert records[-1]["status"] == 200 and records[-1]["principal"] == "alice"


def test_a_client_trusting_another_ca_is_refused(ca, server_cert, gateways, tmp_path, monkeypatch):
    gw = _start(tmp_path, gateways, base_policy(), monkeypatch, *_tls_flags(server_cert))
    other = CertAuthority("Someone Else's CA")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.keys["alice"], max_retries=0,
                           http_client=httpx.Client(verify=other.client_context()))
    with pytest.raises(openai.APIConnectionError) as caught:
        client.models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in repr(caught.value.__cause__)
    with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):  # plain HTTP here gets no answer
        httpx.get(gw.url.replace("https", "http") + "/v1/models", headers=gw.auth())


# ---- mTLS -------------------------------------------------------------------------------------


def _mtls_policy() -> dict[str, Any]:
    policy = base_policy()
    policy["principals"]["ci-bot"] = {"tenant": "globex", "scopes": ["admin"]}
    policy["client_certs"] = {"ci-bot.build.test": "ci-bot"}
    return policy


def test_a_mapped_client_certificate_is_the_principal(ca, server_cert, gateways, tmp_path, monkeypatch):
    gw = _start(tmp_path, gateways, _mtls_policy(), monkeypatch,
                *_tls_flags(server_cert, "--ssl-ca-certs", str(tmp_path / "ca.pem"), "--ssl-cert-reqs", "1"))
    bot = ca.issue("ci runner", dns=("ci-bot.build.test",))
    with httpx.Client(verify=ca.client_context(bot, tmp_path), base_url=gw.url) as client:
        response = client.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2})
        assert response.status_code == 200, response.text
        # A key, when one is sent, still decides who the caller is.
        keyed = client.get("/v1/models", headers=gw.auth("carol"))
        assert keyed.status_code == 200
    first, second = asyncio.run(gw.wait_audit(2))[-2:]
    assert (first["principal"], first["tenant"], first["auth"]) == ("ci-bot", "globex", "mtls")
    assert (second["principal"], second["auth"]) == ("carol", "api_key")


def test_an_unmapped_or_missing_client_certificate_is_refused(ca, server_cert, gateways, tmp_path, monkeypatch):
    gw = _start(tmp_path, gateways, _mtls_policy(), monkeypatch,
                *_tls_flags(server_cert, "--ssl-ca-certs", str(tmp_path / "ca.pem"), "--ssl-cert-reqs", "1"))
    stranger = ca.issue("laptop.corp.test")
    with httpx.Client(verify=ca.client_context(stranger, tmp_path), base_url=gw.url) as client:
        response = client.get("/v1/models")
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "unknown_client_certificate" and "laptop.corp.test" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    with httpx.Client(verify=ca.client_context(), base_url=gw.url) as client:  # optional: no cert, no key
        assert client.get("/v1/models").json()["error"]["code"] == "missing_credentials"
    records = asyncio.run(gw.wait_audit(2))[-2:]
    assert [(r["status"], r["reason"]) for r in records] == [(401, "unknown_client_certificate"),
                                                            (401, "missing_credentials")]


def test_required_client_certificates_refuse_the_handshake(ca, server_cert, gateways, tmp_path, monkeypatch):
    gw = _start(tmp_path, gateways, _mtls_policy(), monkeypatch,
                *_tls_flags(server_cert, "--ssl-ca-certs", str(tmp_path / "ca.pem"), "--ssl-cert-reqs", "2"))
    forged = CertAuthority("Forger").issue("ci-bot.build.test", dns=("ci-bot.build.test",))
    for context in (ca.client_context(), ca.client_context(forged, tmp_path)):
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(gw.url + "/v1/models", verify=context)
    bot = ca.issue("ci-bot.build.test")  # the subject's CN maps too
    assert httpx.get(gw.url + "/v1/models", verify=ca.client_context(bot, tmp_path)).status_code == 200


def test_a_certificate_is_its_sans_not_its_cn_and_one_principal_only(ca, server_cert, gateways, tmp_path,
                                                                      monkeypatch):
    policy = _mtls_policy()
    policy["principals"]["deployer"] = {"tenant": "acme", "scopes": ["admin"]}
    policy["client_certs"]["deploy.build.test"] = "deployer"
    gw = _start(tmp_path, gateways, policy, monkeypatch,
                *_tls_flags(server_cert, "--ssl-ca-certs", str(tmp_path / "ca.pem"), "--ssl-cert-reqs", "1"))
    # A mapped CN beside an unmapped SAN: the CN is not read (a CA may copy a requested CN unchecked).
    borrowed_cn = ca.issue("ci-bot.build.test", dns=("laptop.corp.test",))
    both = ca.issue("ci runner", dns=("ci-bot.build.test", "deploy.build.test"))
    answers = []
    for cert in (borrowed_cn, both):
        with httpx.Client(verify=ca.client_context(cert, tmp_path), base_url=gw.url) as client:
            answers.append(client.get("/v1/models"))
    assert [a.status_code for a in answers] == [401, 401]
    unknown, ambiguous = (a.json()["error"] for a in answers)
    assert unknown["code"] == "unknown_client_certificate" and "laptop.corp.test" in unknown["message"]
    assert ambiguous["code"] == "ambiguous_client_certificate"
    assert "ci-bot" in ambiguous["message"] and "deployer" in ambiguous["message"]
    records = asyncio.run(gw.wait_audit(2))[-2:]
    assert [(r["status"], r["reason"]) for r in records] == [(401, "unknown_client_certificate"),
                                                            (401, "ambiguous_client_certificate")]


@pytest.fixture(autouse=True)
def _ca_file(ca: CertAuthority, tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(ca.issued.pem())


# ---- renewal ------------------------------------------------------------------------------------


def _served_cert(port: int, context: ssl.SSLContext) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return tls.getpeercert(binary_form=True)


def test_a_renewed_certificate_serves_the_next_connection_without_dropping_open_ones(
        ca, server_cert, gateways, tmp_path, monkeypatch):
    gw = _start(tmp_path, gateways, base_policy(), monkeypatch, *_tls_flags(server_cert))
    port, context = int(gw.url.rsplit(":", 1)[1]), ca.client_context()
    old = ca.issue("gateway.test", dns=("localhost",), ip=("127.0.0.1",))
    assert _served_cert(port, context) != old.cert.public_bytes(serialization.Encoding.DER)
    kept = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    kept.request("GET", "/v1/models", headers=gw.auth())
    assert kept.getresponse().read() and kept.sock is not None
    before = kept.sock.getpeercert(binary_form=True)

    renewed = ca.issue("gateway.test", dns=("localhost",), ip=("127.0.0.1",))
    renewed.write(tmp_path, "server")  # the same paths the gateway was started with
    assert _served_cert(port, context) == renewed.cert.public_bytes(serialization.Encoding.DER)
    kept.request("GET", "/v1/models", headers=gw.auth())  # the open connection goes on, as it was
    assert kept.getresponse().status == 200
    assert kept.sock.getpeercert(binary_form=True) == before
    kept.close()


def test_a_half_written_renewal_keeps_the_old_certificate(ca, server_cert, gateways, tmp_path, monkeypatch):
    gw = _start(tmp_path, gateways, base_policy(), monkeypatch, *_tls_flags(server_cert))
    port, context = int(gw.url.rsplit(":", 1)[1]), ca.client_context()
    served = _served_cert(port, context)
    renewed = ca.issue("gateway.test", dns=("localhost",), ip=("127.0.0.1",))
    _replace(server_cert[0], renewed.pem())  # the certificate first: it does not match the old key
    assert _served_cert(port, context) == served
    _replace(server_cert[1], renewed.key_pem())  # then the key: now both load
    assert _served_cert(port, context) == renewed.cert.public_bytes(serialization.Encoding.DER)


def test_a_ca_removed_from_the_bundle_is_refused_at_the_next_handshake(ca, server_cert, gateways, tmp_path,
                                                                        monkeypatch):
    partner = CertAuthority("Partner CA")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(ca.issued.pem() + partner.issued.pem())
    gw = _start(tmp_path, gateways, _mtls_policy(), monkeypatch,
                *_tls_flags(server_cert, "--ssl-ca-certs", str(bundle), "--ssl-cert-reqs", "2"))
    bot = partner.issue("ci runner", dns=("ci-bot.build.test",))
    context = ca.client_context(bot, tmp_path)  # trusts the server's CA, presents the partner's cert
    assert httpx.get(gw.url + "/v1/models", verify=context).status_code == 200
    _replace(bundle, ca.issued.pem())  # the partner CA is withdrawn, without a restart
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.get(gw.url + "/v1/models", verify=context)
    own = ca.issue("ci runner", dns=("ci-bot.build.test",))  # the CA still listed keeps working
    assert httpx.get(gw.url + "/v1/models", verify=ca.client_context(own, tmp_path)).status_code == 200


# ---- start-up refusals --------------------------------------------------------------------------


def _gateway(tmp_path: Path, *flags: str) -> int:
    policy = tmp_path / "policy.yaml"
    write_policy_file(policy, base_policy())
    return cli.main(["gateway", "--policy", str(policy), "--engine-url", "http://127.0.0.1:9", *flags])


def test_tls_flags_that_cannot_work_refuse_to_start(ca, server_cert, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PORTCULLIS_ENGINE_TOKEN", ENGINE_TOKEN)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("started"))
    assert _gateway(tmp_path, "--ssl-certfile", str(server_cert[0]), "--ssl-keyfile", str(server_cert[1]),
                    "--ssl-cert-reqs", "2") == 2
    assert "--ssl-cert-reqs: " in (err := capsys.readouterr().err) and "--ssl-ca-certs" in err
    assert _gateway(tmp_path, "--ssl-keyfile", str(server_cert[1])) == 2
    assert "need --ssl-certfile" in capsys.readouterr().err
    assert _gateway(tmp_path, "--ssl-certfile", str(tmp_path / "missing.pem")) == 2
    assert "--ssl-certfile: " in (err := capsys.readouterr().err) and "does not exist" in err
    other_key = ca.issue("x").write(tmp_path, "other")[1]
    assert _gateway(tmp_path, "--ssl-certfile", str(server_cert[0]), "--ssl-keyfile", str(other_key)) == 2
    assert "cannot use the TLS files" in capsys.readouterr().err


def test_a_client_certificate_mapped_to_an_unlisted_principal_is_an_invalid_policy(tmp_path):
    from portcullis.gateway.policy.loader import PolicyError, load_policy

    policy = base_policy()
    policy["client_certs"] = {"ci-bot.build.test": "nobody"}
    write_policy_file(tmp_path / "policy.yaml", policy)
    with pytest.raises(PolicyError, match="'nobody', which is not listed under principals"):
        load_policy(tmp_path / "policy.yaml")


def test_serve_hands_the_tls_flags_to_its_gateway(tmp_path):
    from portcullis.gateway.tls import tls_argv
    from portcullis.supervisor import serve

    args, engine_flags = serve.build_parser().parse_known_args(
        ["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-cert-reqs", "2", "--ssl-ca-certs", "ca.pem",
         "--max-model-len", "256"])
    assert engine_flags == ["--max-model-len", "256"]  # the engine gets none of them
    argv = tls_argv(args)
    assert argv[argv.index("--ssl-certfile") + 1] == os.path.abspath("c.pem")
    assert argv[argv.index("--ssl-cert-reqs") + 1] == "2" and "--ssl-keyfile" in argv and "--ssl-ca-certs" in argv
    assert cli.build_parser().parse_args(["gateway", "--policy", "p", *argv]).ssl_cert_reqs == 2
