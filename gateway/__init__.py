"""Portcullis gateway: the public, policy-enforcing front of a Portcullis deployment.

What it owns
    * The public HTTP port (OpenAI-compatible routes, as the policy lists them).
    * Authentication: API keys (`ptc_<id>.<secret>`, stored only as salted hashes) and JWTs
      (RS256/ES256 from a JWKS, HS256 from a secret), each resolving to a principal
      (id, tenant, scopes).
    * Authorisation: the route allowlist (paths normalised before matching), per-tenant and
      per-principal model lists, caps on max_tokens, prompt tokens and body size.
    * Rate limits per key and per tenant: requests/min, tokens/min, concurrent requests
      (in memory, or shared through Redis).
    * The audit log: one hash-chained JSON line per request, refusals included.
    * The policy YAML (`gateway.policy`), hot-reloaded, and the `portcullis` command line
      (`gateway.cli`): `gateway`, `keys`, `policy check`, `audit`.

What it may import
    Its own modules and third-party libraries. It never imports `engine` or `kernels`: it
    talks to the engine only over HTTP on the private channel (a Unix socket by default,
    or a private address), adding the internal token itself and never forwarding the
    client's credentials. The engine contract it relies on is the OpenAI-compatible API
    plus `cache_salt`, `x-request-id` echo and the usage chunk of streamed responses.

Layout
    app.py (FastAPI factory) · settings.py · deps.py · state.py (per-process parts) ·
    routers/ (health, proxy) · policy/ (models, loader, store, schema) · auth/ (API keys,
    JWT, credential resolution) · allowlist.py · access.py · body.py · ratelimit.py ·
    forward.py + sse.py (the proxy) · engine_client.py + engine_transport.py (the private
    channel) · record.py + audit/ (log, review) · metrics.py · oplog.py · keys.py · cli.py ·
    serve.py (`portcullis serve`)
"""
