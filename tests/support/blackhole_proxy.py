"""A TCP proxy for fault drills: relays bytes to a real server until told to blackhole, then keeps every connection
open, reads whatever arrives and never forwards or answers (a peer that hangs without closing connections).
RecordingProxy relays and notes each HTTP/1.1 exchange that passes (request line, status), to see what a client in
front of a server asks it."""

from __future__ import annotations

import re
import selectors
import socket
import threading


class BlackholeProxy:
    """Listens on a loopback port and relays to upstream; `blackhole()` makes it swallow everything from then on."""

    def __init__(self, upstream_host: str, upstream_port: int):
        self.upstream = (upstream_host, upstream_port)
        self.blackholing = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict[socket.socket, socket.socket | None] = {}
        self._clients: set[socket.socket] = set()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blackhole proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def start(self) -> BlackholeProxy:
        self._thread.start()
        return self

    def blackhole(self) -> None:
        self.blackholing.set()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)
        for sock in [self._listener, *self._peers]:
            sock.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._closing.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._pump(key.fileobj)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        upstream = None
        self._clients.add(client)
        if not self.blackholing.is_set():  # a blackholed server still accepts: the kernel's backlog does that
            upstream = socket.create_connection(self.upstream, timeout=5)
            self._add(upstream, client)
        self._add(client, upstream)

    def _add(self, sock: socket.socket, peer: socket.socket | None) -> None:
        self._peers[sock] = peer
        self._selector.register(sock, selectors.EVENT_READ, None)

    def _pump(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        peer = self._peers.get(sock)
        if self.blackholing.is_set():
            if not data:  # a side that closes is let go, but the other side hears nothing of it
                self._drop(sock)
            return
        if data:
            self._observe(sock in self._clients, sock if sock in self._clients else peer, data)
        if data and peer is not None:
            try:
                peer.sendall(data)
                return
            except OSError:
                pass
        self._drop(sock)
        if peer is not None:
            self._drop(peer)

    def _observe(self, from_client: bool, client: socket.socket | None, data: bytes) -> None:
        """Bytes about to be relayed, from the client side or the server's."""

    def _drop(self, sock: socket.socket) -> None:
        if sock in self._peers:
            self._selector.unregister(sock)
            del self._peers[sock]
            sock.close()


_REQUEST_LINE = re.compile(rb"(GET|POST|PUT|DELETE|HEAD|OPTIONS|PATCH) (\S+) HTTP/1\.[01]\r\n")
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


class RecordingProxy(BlackholeProxy):
    """Relays like BlackholeProxy and notes each exchange: `exchanges()` lists (method path, status) in order per
    connection (a request line or status line split across two reads is missed: fine for the short ones tested)."""

    def __init__(self, upstream_host: str, upstream_port: int):
        super().__init__(upstream_host, upstream_port)
        self._requests: dict[int, list[str]] = {}
        self._statuses: dict[int, list[int]] = {}

    def _observe(self, from_client: bool, client: socket.socket | None, data: bytes) -> None:
        key = id(client)
        if from_client:
            self._requests.setdefault(key, []).extend(
                f"{m.group(1).decode()} {m.group(2).decode()}" for m in _REQUEST_LINE.finditer(data))
        else:
            self._statuses.setdefault(key, []).extend(int(m.group(1)) for m in _STATUS_LINE.finditer(data))

    def exchanges(self) -> list[tuple[str, int | None]]:
        out = []
        for key, requests in list(self._requests.items()):
            statuses = self._statuses.get(key, [])
            out.extend((r, statuses[i] if i < len(statuses) else None) for i, r in enumerate(requests))
        return out
