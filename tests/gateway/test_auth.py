"""Authentication matrix: API keys (missing, wrong, revoked, expired, rotated, in the query
string) and JWTs (valid, expired, not yet valid, wrong issuer/audience, alg none, HS/RS
confusion, unknown kid, tampered payload). Every case writes exactly one audit line."""

from __future__ import annotations

import base64
import json
import time
from datetime import timedelta

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from portcullis.gateway.auth.keys import KeyBook, utcnow

from .conftest import HS_SECRET, base_policy

BODY = {"model": "demo", "prompt": "hello", "max_tokens": 2}


def _unsigned(claims: dict) -> str:
    def enc(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{enc({'alg': 'none', 'typ': 'JWT'})}.{enc(claims)}."


def _tampered(token: str) -> str:
    head, payload, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["tenant"] = "globex"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{head}.{forged}.{sig}"


async def _post(gw, headers, path="/v1/completions", **kw):
    async with gw.client() as client:
        return await gw.call(client, "POST", path, json=BODY, headers=headers, **kw)


KEY_CASES = [
    # (case, headers builder, expected status, expected reason)
    ("no credentials", lambda gw: {}, 401, "missing_credentials"),
    ("wrong secret", lambda gw: {"authorization": "Bearer " + gw.keys["alice"][:-4] + "AAAA"}, 401, "invalid_key"),
    ("unknown key id", lambda gw: {"authorization": "Bearer ptc_000000000000.abc"}, 401, "invalid_key"),
    ("garbage token", lambda gw: {"authorization": "Bearer hunter2"}, 401, "invalid_key"),
    ("basic scheme", lambda gw: {"authorization": "Basic Zm9vOmJhcg=="}, 401, "malformed_credentials"),
    ("valid bearer", lambda gw: gw.auth("alice"), 200, "ok"),
    ("valid x-api-key", lambda gw: {"x-api-key": gw.keys["alice"]}, 200, "ok"),
]


@pytest.mark.parametrize("case,headers,status,reason", KEY_CASES, ids=[c[0] for c in KEY_CASES])
async def test_api_key_matrix(gw, case, headers, status, reason):
    response, record = await _post(gw, headers(gw))
    assert response.status_code == status, response.text
    assert record["reason"] == reason and record["status"] == status
    if status == 200:
        assert record["principal"] == "alice" and record["tenant"] == "acme"
        assert record["key_id"] == gw.keys["alice"][4:].split(".")[0]
    else:
        assert response.json()["error"]["code"] == reason
        assert record["decision"] == "denied" and record["principal"] is None


@pytest.mark.parametrize("param", ["api_key", "key", "token", "access_token"])
async def test_key_in_query_string_is_refused(gw, param):
    response, record = await _post(gw, gw.auth(), path=f"/v1/completions?{param}={gw.keys['alice']}")
    assert response.status_code == 401
    assert record["reason"] == "credentials_in_query"
    assert gw.keys["alice"] not in gw.audit_text()


async def test_revoked_and_expired_keys(gw):
    book = KeyBook(gw.folder / "keys.yaml")
    alice_id = gw.keys["alice"][4:].split(".")[0]
    bob_id = gw.keys["bob"][4:].split(".")[0]
    book.revoke(alice_id)
    book.replace(book.find(bob_id).model_copy(update={"expires_at": utcnow() - timedelta(seconds=1)}))
    await _wait_reload(gw)
    for name, reason, key_id in (("alice", "key_revoked", alice_id), ("bob", "key_expired", bob_id)):
        response, record = await _post(gw, gw.auth(name))
        assert response.status_code == 401 and record["reason"] == reason
        # The caller proved it holds the key's secret: the audit says whose key is still in use.
        assert record["principal"] == name and record["key_id"] == key_id and record["tenant"] == "acme"
        assert record["decision"] == "denied"


async def test_rotated_key_works_during_overlap_only(gw):
    book = KeyBook(gw.folder / "keys.yaml")
    old_id = gw.keys["carol"][4:].split(".")[0]
    new_token, new, old = book.rotate(old_id, timedelta(hours=1))
    await _wait_reload(gw)
    for token in (gw.keys["carol"], new_token):  # inside the overlap both work
        response, _ = await _post(gw, {"authorization": f"Bearer {token}"})
        assert response.status_code == 200
    gw.gateway.clock = lambda: utcnow() + timedelta(hours=2)  # time travel past the overlap
    response, record = await _post(gw, {"authorization": f"Bearer {gw.keys['carol']}"})
    assert response.status_code == 401 and record["reason"] == "key_expired"
    response, _ = await _post(gw, {"authorization": f"Bearer {new_token}"})
    assert response.status_code == 200


async def _wait_reload(gw, timeout=2.0):
    generation = gw.gateway.store.generation
    deadline = time.monotonic() + timeout
    while gw.gateway.store.generation == generation:
        assert time.monotonic() < deadline, "policy change not applied within 2 s"
        time.sleep(0.02)


def _public_pem(keys) -> bytes:
    return keys.rsa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _none_token(keys) -> str:
    return _unsigned({"sub": "dave", "tenant": "acme", "iss": "https://idp.test", "aud": "portcullis",
                      "exp": int(time.time()) + 300})


JWT_CASES = [  # (case, token builder, status, reason)
    ("valid RS256", lambda k: k.token("RS256"), 200, "ok"),
    ("valid ES256", lambda k: k.token("ES256"), 200, "ok"),
    ("expired", lambda k: k.token(exp=int(time.time()) - 60), 401, "jwt_expired"),
    ("not yet valid", lambda k: k.token(nbf=int(time.time()) + 600), 401, "jwt_not_yet_valid"),
    ("wrong issuer", lambda k: k.token(iss="https://evil.test"), 401, "jwt_wrong_issuer"),
    ("wrong audience", lambda k: k.token(aud="someone-else"), 401, "jwt_wrong_audience"),
    ("alg none", _none_token, 401, "jwt_algorithm_refused"),
    ("HS256 signed with the RSA public key", lambda k: _hs_with_public_key(_public_pem(k)), 401,
     "jwt_algorithm_refused"),
    ("unknown kid", lambda k: k.token(kid="rsa-9"), 401, "jwt_unknown_kid"),
    ("signed by a stranger", lambda k: k.token(key=k.other_rsa), 401, "jwt_bad_signature"),
    ("tampered payload", lambda k: _tampered(k.token()), 401, "jwt_bad_signature"),
    ("missing exp", lambda k: k.token(exp=None), 401, "jwt_missing_claim"),
    ("unknown tenant", lambda k: k.token(tenant="initech"), 403, "jwt_unknown_tenant"),
]


def _hs_with_public_key(public_pem: bytes) -> str:
    # PyJWT refuses to sign with a PEM as an HMAC secret, so forge it by hand, as an
    # attacker would.
    import hashlib
    import hmac

    def enc(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    now = int(time.time())
    head = enc(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}).encode())
    body = enc(json.dumps({"sub": "dave", "tenant": "acme", "iss": "https://idp.test",
                           "aud": "portcullis", "exp": now + 300}).encode())
    sig = hmac.new(public_pem, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{enc(sig)}"


@pytest.mark.parametrize("case,build,status,reason", JWT_CASES, ids=[c[0] for c in JWT_CASES])
async def test_jwt_matrix(gw, jwt_keys, case, build, status, reason):
    response, record = await _post(gw, {"authorization": f"Bearer {build(jwt_keys)}"})
    assert response.status_code == status, response.text
    assert record["reason"] == reason
    if status == 200:
        assert record["principal"] == "dave" and record["auth"] == "jwt" and record["key_id"] is None


async def test_hs256_confusion_when_hs256_is_also_allowed(gateways, jwt_keys):
    """Even with HS256 enabled, a token 'signed' with the RSA public key is refused."""
    policy = base_policy()
    policy["jwt"].update(algorithms=["RS256", "HS256"], hs256_secret_env="PORTCULLIS_TEST_HS256_SECRET")
    gw = gateways.start(policy)
    response, record = await _post(gw, {"authorization": f"Bearer {_hs_with_public_key(_public_pem(jwt_keys))}"})
    assert response.status_code == 401 and record["reason"] == "jwt_bad_signature"
    good = jwt.encode({"sub": "erin", "tenant": "acme", "iss": "https://idp.test", "aud": "portcullis",
                       "exp": int(time.time()) + 60}, HS_SECRET, algorithm="HS256")
    response, record = await _post(gw, {"authorization": f"Bearer {good}"})
    assert response.status_code == 200 and record["principal"] == "erin"


async def test_jwks_reloaded_on_unknown_kid(gw, jwt_keys):
    token = jwt_keys.token(kid="rsa-2", key=jwt_keys.other_rsa)
    response, _ = await _post(gw, {"authorization": f"Bearer {token}"})
    assert response.status_code == 401
    jwks = jwt_keys.jwks()
    entry = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(jwt_keys.other_rsa.public_key()))
    jwks["keys"].append({**entry, "kid": "rsa-2", "use": "sig"})
    (gw.folder / "jwks.json").write_text(json.dumps(jwks))
    response, _ = await _post(gw, {"authorization": f"Bearer {token}"})
    assert response.status_code == 200


async def test_failed_auth_is_throttled_but_never_blocks_a_valid_credential(gateways):
    """Behind a reverse proxy every client shares one address: a burst of bad tokens from it
    must slow the bad tokens down, never lock out the clients whose credentials are good."""
    policy = base_policy()
    policy["rate_limits"] = {"auth_failures_per_minute": 3}
    gw = gateways.start(policy)
    for _ in range(3):
        response, _ = await _post(gw, {"authorization": "Bearer ptc_aaaaaaaaaaaa.wrong"})
        assert response.status_code == 401
    response, record = await _post(gw, {"authorization": "Bearer ptc_aaaaaaaaaaaa.wrong"})
    assert response.status_code == 429 and record["reason"] == "auth_rate_limit"
    assert int(response.headers["retry-after"]) >= 1
    assert "failed authentication" in response.json()["error"]["message"]
    response, record = await _post(gw, gw.auth("alice"))  # a good key from the same address
    assert response.status_code == 200 and record["reason"] == "ok"


async def test_failed_auth_throttle_is_per_credential_then_per_address(gateways):
    """One client retrying its revoked key does not throttle a neighbour's typo; only a flood
    of many different bad credentials from one address (ten times the limit) does."""
    policy = base_policy()
    policy["rate_limits"] = {"auth_failures_per_minute": 2}
    gw = gateways.start(policy)
    for _ in range(2):
        await _post(gw, {"authorization": "Bearer ptc_aaaaaaaaaaaa.wrong"})
    response, _ = await _post(gw, {"authorization": "Bearer ptc_aaaaaaaaaaaa.wrong"})
    assert response.status_code == 429
    response, record = await _post(gw, {"authorization": "Bearer ptc_bbbbbbbbbbbb.wrong"})
    assert response.status_code == 401 and record["reason"] == "invalid_key"
    for i in range(20):
        await _post(gw, {"authorization": f"Bearer ptc_{i:012d}.wrong"})
    response, record = await _post(gw, {"authorization": "Bearer ptc_cccccccccccc.wrong"})
    assert response.status_code == 429 and record["reason"] == "auth_rate_limit"
    response, _ = await _post(gw, gw.auth("bob"))
    assert response.status_code == 200


BAD_CLAIMS = [
    ("tenant as list", {"tenant": ["acme"]}),
    ("tenant as dict", {"tenant": {"name": "acme"}}),
    ("tenant as number", {"tenant": 7}),
    ("scope as int", {"scope": 5}),
    ("scope as dict", {"scope": {"admin": True}}),
    ("scope list of non-strings", {"scope": [1, {"a": 2}]}),
    ("subject as list", {"sub": ["dave"]}),
    ("subject too long", {"sub": "d" * 10_000}),
]


@pytest.mark.parametrize("case,claims", BAD_CLAIMS, ids=[c[0] for c in BAD_CLAIMS])
async def test_jwt_with_malformed_claims_is_a_401_not_a_500(gw, jwt_keys, case, claims):
    token = jwt_keys.token(**claims)
    response, record = await _post(gw, {"authorization": f"Bearer {token}"})
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["code"] == "jwt_invalid_claim" and record["reason"] == "jwt_invalid_claim"
    assert "claim" in error["message"]


async def test_jwt_subject_limits_are_per_tenant(gateways, jwt_keys):
    """The same `sub` issued for two tenants is two callers: one's per-key budget is not the other's."""
    policy = base_policy()
    policy["tenants"]["acme"]["key_limits"] = {"requests_per_minute": 1}
    policy["tenants"]["globex"]["key_limits"] = {"requests_per_minute": 1}
    gw = gateways.start(policy)
    acme = {"authorization": f"Bearer {jwt_keys.token(sub='sam', tenant='acme')}"}
    globex = {"authorization": f"Bearer {jwt_keys.token(sub='sam', tenant='globex')}"}
    assert (await _post(gw, acme))[0].status_code == 200
    response, record = await _post(gw, globex)
    assert response.status_code == 200, response.text
    assert record["tenant"] == "globex"
    assert (await _post(gw, acme))[0].status_code == 429


async def test_jwks_url_is_cached_and_refetched_on_unknown_kid(jwt_keys, tmp_path):
    from portcullis.gateway.auth.tokens import JwksCache
    from portcullis.gateway.policy.models import JwtSettings

    fetches = []
    served = {"keys": [k for k in jwt_keys.jwks()["keys"] if k["kid"] == "rsa-1"]}

    def handler(request: httpx.Request) -> httpx.Response:
        fetches.append(str(request.url))
        return httpx.Response(200, json=served)

    settings = JwtSettings(algorithms=["RS256", "ES256"], issuer="i", audience="a",
                           jwks_url="https://idp.test/jwks", jwks_refresh_min_seconds=0)
    cache = JwksCache(transport=httpx.MockTransport(handler))
    assert await cache.get("rsa-1", settings, tmp_path) is not None
    assert await cache.get("rsa-1", settings, tmp_path) is not None
    assert len(fetches) == 1  # cached
    assert await cache.get("ec-1", settings, tmp_path) is None
    served["keys"] = jwt_keys.jwks()["keys"]  # the IdP publishes a new key
    assert await cache.get("ec-1", settings, tmp_path) is not None
    assert len(fetches) == 3
    throttled = settings.model_copy(update={"jwks_refresh_min_seconds": 60})
    cache2 = JwksCache(transport=httpx.MockTransport(handler))
    await cache2.get("nope-1", throttled, tmp_path)
    await cache2.get("nope-2", throttled, tmp_path)
    assert len(fetches) == 4  # unknown kids cannot make us hammer the IdP
