"""The gateway's client to its engines (gateway/engines/client.py): an engine's every failure reaches the proxy as the
httpx error it handles (an engine's fault, retried or ended as one), and a relay that stops reading closes the
engine's connection, so the engine sees its client go. The engines here are raw sockets on loopback, written in this
file: no real engine answers with a broken status line or a body cut short on demand."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from kvfleet.gateway.engines.client import engine_client


async def serving(answer: bytes, seen: asyncio.Queue) -> tuple[asyncio.Server, str]:
    """A server that reads one request, writes `answer` and closes, or leaves the connection open when answer ends
    with b"..." (and reports on `seen` when its client closes it)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer.removesuffix(b"..."))
        await writer.drain()
        if answer.endswith(b"..."):
            await seen.put(await reader.read())  # b"" once the client closed its end
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.asyncio
@pytest.mark.parametrize("answer,error", [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this", httpx.RemoteProtocolError),  # a body cut short
    (b"NOT HTTP AT ALL\r\n\r\n", httpx.RemoteProtocolError),  # a status line no server sends
    (b"", httpx.RemoteProtocolError),  # closed without answering
])
async def test_an_engine_that_breaks_its_answer_is_an_httpx_error(answer: bytes, error: type) -> None:
    server, url = await serving(answer, asyncio.Queue())
    client = engine_client(5.0)
    try:
        with pytest.raises(error):
            response = await client.send(client.build_request("POST", f"{url}/v1/completions", content=b"{}"),
                                         stream=True)
            async for _ in response.aiter_raw():
                pass
    finally:
        await client.aclose()
        server.close()


@pytest.mark.asyncio
async def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once it is closed
    client = engine_client(5.0)
    try:
        with pytest.raises(httpx.ConnectError):
            await client.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{}")
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_a_relay_that_stops_reading_closes_the_engines_connection() -> None:
    seen: asyncio.Queue = asyncio.Queue()
    stream = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    server, url = await serving(stream + b"6\r\ndata: \r\n...", seen)
    client = engine_client(5.0)
    try:
        response = await client.send(client.build_request("GET", f"{url}/v1/chat/completions"), stream=True)
        assert response.status_code == 200 and await anext(response.aiter_raw()) == b"data: "
        await response.aclose()  # the client left mid-answer
        async with asyncio.timeout(5):
            assert await seen.get() == b""  # the engine saw its connection close
    finally:
        await client.aclose()
        server.close()
