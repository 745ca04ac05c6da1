"""Clients of a gateway: a completion recorded with the time it finished, and a client that leaves when the test
says."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx


def send(gateway: str, model: str, priority: str, results: dict, name: str, max_tokens: int = 8,
         timeout: float = 120, **headers: str) -> None:
    try:
        r = httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": name, "max_tokens": max_tokens,
                                                           "ignore_eos": True},
                       headers={"x-kvfleet-priority": priority, **headers}, timeout=timeout)
        results[name] = (r, time.monotonic())
    except httpx.TimeoutException as err:
        results[name] = (err, time.monotonic())


class LeavingClient:
    """A completion request whose client waits until told to leave, then closes its connection, as a client that
    gives up does: when it leaves is the test's choice (once the state it checks holds), not a timeout's."""

    def __init__(self, url: str, body: dict, **headers: str) -> None:
        address = httpx.URL(url)
        data = json.dumps(body).encode()
        head = "".join(f"{name}: {value}\r\n" for name, value in {
            "host": address.host, "content-type": "application/json", "content-length": str(len(data)),
            **headers}.items())
        self.sock = socket.create_connection((address.host, address.port), timeout=10)
        self.sock.sendall(f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode() + data)

    def leave(self) -> bytes:
        """Closes the connection; whatever of an answer had arrived before (b"": nothing)."""
        self.sock.setblocking(False)
        try:
            received = self.sock.recv(65536) or b"(the server closed the connection)"
        except BlockingIOError:
            received = b""
        self.sock.close()
        return received


def complete(gateway: str, model: str, prompt: str, max_tokens: int = 8, timeout: float = 60,
             **headers: str) -> tuple[httpx.Response | Exception, float]:
    """A non-streaming request; returns (response or the client's exception, seconds it took)."""
    started = time.monotonic()
    try:
        r = httpx.post(f"{gateway}/v1/completions", headers=headers, timeout=timeout,
                       json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        return r, time.monotonic() - started
    except httpx.HTTPError as err:
        return err, time.monotonic() - started


def finished(fn: Callable, *args: object) -> tuple[object, float]:
    """fn's result and when it came."""
    result = fn(*args)
    return result, time.monotonic()


def is_openai_error(r: httpx.Response) -> bool:
    try:
        return {"message", "type", "param", "code"} <= r.json()["error"].keys()
    except (ValueError, KeyError, AttributeError):
        return False
