"""Portcullis gateway: the public, policy-enforcing front of a Portcullis deployment.

What it owns
    * The public HTTP port (OpenAI-compatible routes, as the policy lists them), over HTTPS
      when given a certificate (`tls`: renewals without restart, HSTS, mTLS client certificates
      mapped to principals by the policy's `client_certs`).
    * Authentication: API keys (`ptc_<id>.<secret>`, stored only as salted hashes) and JWTs
      (RS256/ES256 from a JWKS, HS256 from a secret), each resolving to a principal
      (id, tenant, scopes).
    * Authorisation: the route allowlist (paths normalised before matching), per-tenant and
      per-principal model lists, caps on max_tokens, prompt tokens (embedding inputs and FIM
      suffixes included) and body size, and the engine `priority` a tenant or principal gets.
    * Rate limits per key and per tenant: requests/min, tokens/min, concurrent requests, and
      token and request budgets per UTC day and month (in memory, or shared through Redis).
    * The audit log: one HMAC-chained JSON line per request, refusals included (prompt and
      suffix fingerprinted by HMAC, tool calls counted), with signed checkpoints, written by a
      thread through a bounded queue; its keys live in a keyring outside the log's folder.
    * Export: Prometheus metrics summed over `--workers` (`metrics`), OpenTelemetry traces
      (`telemetry`, the optional `otel` extra) and audit lines mirrored to syslog (`syslog`).
    * The engines behind it (`upstream.fleet`): one per `--engine-url`, or the policy's
      `upstreams`, routed by model, balanced by load and prefix, health-checked, failed over.
    * The console (`console`): pages and a JSON API under `/gateway/console` for the policy's
      admin scope (audit search and chain status, usage and budgets, keys, policy, fleet;
      key and policy writes only for `console.write_scope`), read off the event loop.
    * The policy YAML (`gateway.policy`), hot-reloaded. The `portcullis` command line that runs
      and administers it lives in `portcullis.cli`; `portcullis serve` in `portcullis.supervisor`.

What it may import
    Its own modules, `protocol`, the leaves `envs`, `host` and `oplog`, and the base install's third-party
    libraries (no torch: the gateway's install has none), their internals only through
    `compat/`. It never imports `engine` or `kernels`: it
    talks to the engine only over HTTP on the private channel (a Unix socket by default,
    or a private address), adding the internal token itself and never forwarding the
    client's credentials. The engine contract it relies on is the OpenAI-compatible API
    plus `cache_salt`, `x-request-id` echo and the usage chunk of streamed responses.

Layout
    app.py (FastAPI factory) · settings.py · deps.py (the `GatewayDep` alias) · state.py
    (`GatewayState`, the per-process parts) · routers/ (health, proxy) · proxy_call.py (one
    request through the proxy) · policy/ (models, loader, store, schema) · auth/ (key format and
    keys file, API keys, JWT, client certificates, credential resolution) · allowlist.py · access.py · body.py (with responses_input.py) ·
    ratelimit.py · budgets.py (budget counters) · upstream/ (engine client and transport, the fleet, forwarding, SSE) · audit/ (the request
    record, the log and its writer thread, review) · console/ (pages, reads, writes) · connection.py · errors.py · metrics.py ·
    tls.py · telemetry.py · syslog.py · compat/ (what it relies on of `limits`' and
    uvicorn's internals, pinned by contract tests)
"""
