"""`EngineClient`: the gateway's only way to the engine, HTTP over the private channel.

One pooled `httpx.AsyncClient` per gateway process, over a Unix socket by default. It adds
the internal token itself; nothing from the client's own headers is copied in wholesale.
"""

from __future__ import annotations

import httpx

UNIX_PREFIX = "unix://"


def _transport_and_base(url: str) -> tuple[httpx.AsyncHTTPTransport, str]:
    pool = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    if url.startswith(UNIX_PREFIX):
        # The host part is never resolved; it only fills the Host header.
        return httpx.AsyncHTTPTransport(uds=url[len(UNIX_PREFIX) :], limits=pool), "http://engine"
    return httpx.AsyncHTTPTransport(limits=pool), url.rstrip("/")


class EngineClient:
    def __init__(self, url: str, token: str, read_timeout_s: float = 600.0) -> None:
        transport, base = _transport_and_base(url)
        self.url = url
        self._client = httpx.AsyncClient(
            transport=transport,
            base_url=base,
            headers={"authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(connect=5.0, read=read_timeout_s, write=60.0, pool=30.0),
            follow_redirects=False,
        )

    async def open(
        self, method: str, path: str, body: bytes | None, request_id: str
    ) -> httpx.Response:
        """Send a request and return as soon as the response head arrives (body unread)."""
        headers = {"x-request-id": request_id}
        if body is not None:
            headers["content-type"] = "application/json"
        request = self._client.build_request(method, path, content=body, headers=headers)
        return await self._client.send(request, stream=True)

    async def post_json(self, path: str, payload: bytes, request_id: str) -> httpx.Response:
        response = await self.open("POST", path, payload, request_id)
        await response.aread()
        return response

    async def healthy(self) -> bool:
        try:
            response = await self._client.get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def close(self) -> None:
        await self._client.aclose()
