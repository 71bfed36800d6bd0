"""The engine transport against tiny raw servers: keep-alive reuse, chunked bodies, a sized body
read whole, a stale connection retried once, early close, and errors mapped to httpx's
exception types."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from portcullis.gateway.upstream.transport import EngineTransport


class RawServer:
    """A Unix-socket server whose handler writes canned bytes for each request head."""

    def __init__(self, path: str, replies: list[bytes], close_after_each: bool = False) -> None:
        self.path, self.replies, self.close_after_each = path, replies, close_after_each
        self.connections = 0
        self.closed_by_client = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while self.replies:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                self.closed_by_client.set()
                break
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
            if length:
                await reader.readexactly(length[0])
            writer.write(self.replies.pop(0))
            await writer.drain()
            if self.close_after_each:
                break
        if not self.close_after_each:
            await reader.read()  # wait for the client to hang up
            self.closed_by_client.set()
        writer.close()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_unix_server(self.handle, self.path)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           b"7\r\ndata: 1\r\n7\r\ndata: 2\r\n0\r\n\r\n")


async def _get(transport: EngineTransport) -> httpx.Response:
    return await transport.request(b"POST", b"/v1/completions", [b"x-request-id: r"], b"{}")


async def test_keep_alive_reuses_one_connection(tmp_path):
    async with RawServer(str(tmp_path / "s"), [OK, OK, OK]) as server:
        transport = EngineTransport(uds=server.path)
        for _ in range(3):
            response = await _get(transport)
            assert (await response.aread()) == b"{}"
            await response.aclose()
        assert server.connections == 1
        await transport.aclose()


async def test_chunked_body_arrives_chunk_by_chunk(tmp_path):
    async with RawServer(str(tmp_path / "s"), [CHUNKED]) as server:
        transport = EngineTransport(uds=server.path)
        response = await _get(transport)
        assert [c async for c in response.aiter_raw()] == [b"data: 1", b"data: 2"]
        await response.aclose()
        await transport.aclose()


async def test_a_sized_body_read_whole_waits_for_late_pieces_and_keeps_the_connection(tmp_path):
    """The proxy reads a Content-Length body in one call (`EngineBody.read_sized`), also when it
    comes after its head and in pieces; read to the end, its connection serves the next request."""
    body = b'{"text":"' + b"x" * 3000 + b'"}'
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for _ in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
            for piece in (body[:1000], body[1000:]):
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(piece)
        await reader.read()
        writer.close()

    server = await asyncio.start_unix_server(handle, str(tmp_path / "s"))
    transport = EngineTransport(uds=str(tmp_path / "s"))
    for _ in range(2):
        response = await _get(transport)
        assert response.stream.sized and await response.stream.read_sized() == body
        await response.aclose()
    assert connections == 1
    await transport.aclose()
    server.close()


async def test_stale_kept_alive_connection_is_retried_once(tmp_path):
    async with RawServer(str(tmp_path / "s"), [OK, OK], close_after_each=True) as server:
        transport = EngineTransport(uds=server.path)
        first = await _get(transport)
        await first.aread()
        await first.aclose()  # pooled, but the server has closed its end
        await asyncio.sleep(0.05)
        second = await _get(transport)
        assert (await second.aread()) == b"{}"
        assert server.connections == 2
        await transport.aclose()


async def test_closing_an_unread_body_closes_the_connection(tmp_path):
    async with RawServer(str(tmp_path / "s"), [CHUNKED[:-5]]) as server:  # a stream still running
        transport = EngineTransport(uds=server.path)
        response = await _get(transport)
        await response.aclose()
        await asyncio.wait_for(server.closed_by_client.wait(), 2)
        assert len(transport._idle) == 0  # never pooled: the engine must see the hang-up
        await transport.aclose()


async def test_errors_map_to_httpx_types(tmp_path):
    with pytest.raises(httpx.ConnectError):
        await _get(EngineTransport(uds=str(tmp_path / "missing.sock")))
    async with RawServer(str(tmp_path / "s"), [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"],
                         close_after_each=True) as server:
        response = await _get(EngineTransport(uds=server.path))
        with pytest.raises(httpx.ReadError):
            await response.aread()
    async with RawServer(str(tmp_path / "t"), [b""]) as server:
        with pytest.raises(httpx.ReadTimeout):
            await _get(EngineTransport(uds=server.path, read_timeout=0.2))
