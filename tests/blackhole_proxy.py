"""A TCP proxy for fault drills: relays bytes to a real server until told to blackhole, then keeps every connection
open, reads whatever arrives and never forwards or answers (a peer that hangs without closing connections)."""

from __future__ import annotations

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
        if data and peer is not None:
            try:
                peer.sendall(data)
                return
            except OSError:
                pass
        self._drop(sock)
        if peer is not None:
            self._drop(peer)

    def _drop(self, sock: socket.socket) -> None:
        if sock in self._peers:
            self._selector.unregister(sock)
            del self._peers[sock]
            sock.close()
