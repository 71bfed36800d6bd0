"""Upstream: the gateway's side of the private channel to the engine.

What it owns
    * `client.EngineClient`: the one HTTP client to the engine (a Unix socket by default, or a
      private address), which adds the internal token and copies none of the client's headers.
    * `transport.EngineTransport`: its keep-alive connection pool, O(1) per request.
    * `forward.Exchange`: the proxy pipeline's last stage, the engine call for one admitted
      request: relays the answer (closing the engine's request if the client hangs up), then
      settles the rate limits and writes the audit line.
    * `sse.SseRelay`: passes the engine's Server-Sent Events through, reading their `usage`.
    * `fleet.Fleet`: the replicas of the policy's `upstreams` (or the one `--engine-url`), their
      health and load, and the choice of a replica per request (model group, load, prefix).

What it may import
    httpx, starlette, and the gateway modules a forwarded request carries: `proxy_call`,
    `errors`, `ratelimit` (settling) and, through the call, the audit record. Never the routers
    (they import this), and never `engine` or `kernels`: the engine is reached over HTTP only.
"""
