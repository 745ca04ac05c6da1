"""A test's view of vLLM-format KV events: a SUB socket that collects frames in a thread, a replay request, and a
fake vLLM pod (PUB + replay ROUTER + /kv_event_sources) that sends whatever frames a test gives it."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class LiveFrames:
    """Every `[topic, seq, payload]` message a SUB socket receives, in order."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.frames: list[list[bytes]] = []
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.setsockopt(zmq.RCVTIMEO, 100)
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        time.sleep(0.3)  # ZMQ's slow joiner: what is published before the subscription lands is not seen

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.frames.append(self._sub.recv_multipart())
            except zmq.Again:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(linger=0)
        self._context.term()

    def batches(self) -> list[tuple[int, list]]:
        """(seq, decoded [ts, events, rank]) of each message so far."""
        return [(int.from_bytes(f[1], "big"), msgpack.unpackb(f[2])) for f in list(self.frames)]

    def wait_for(self, what, timeout: float = 20.0):  # noqa: ANN001 - a predicate over this view
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = what(self)
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"the ZMQ stream never showed it; messages: {self.batches()[-5:]}")


def replay(endpoint: str, start: int, timeout_ms: int = 5000) -> list[list[bytes]]:
    """What a DEALER gets for a replay request from `start`, up to and including the end marker."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, timeout_ms)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            frames = dealer.recv_multipart()
            got.append(frames)
            if frames[2] == END_SEQ:
                return got
    finally:
        dealer.close(linger=0)
        context.term()


class FakeVllmPod:
    """A pod that publishes what the test sends (PUB), replays from its own list (ROUTER, vLLM's layout), and names
    both on /kv_event_sources with a wildcard host as vLLM does."""

    def __init__(self) -> None:
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_delay = 0.0  # seconds a replay request waits: live batches sent meanwhile are replayed too
        self._context = zmq.Context()
        self.pub = self._context.socket(zmq.XPUB)  # a PUB that hears each subscription: a test can wait for one
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self._context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVTIMEO, 100)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.pub_port}",
                         "replay_endpoint": f"tcp://*:{self.replay_port}", "buffer_steps": 100, "hwm": 100,
                         "max_queue_size": 100, "topic": ""}}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = json.dumps(sources if self.path == "/kv_event_sources" else {}).encode()
                self.send_response(200 if self.path == "/kv_event_sources" else 404)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # noqa: ANN002 - quiet
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self._threads = [threading.Thread(target=self.http.serve_forever, daemon=True),
                         threading.Thread(target=self._serve_replays, daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, seq: int, payload: bytes, live: bool = True) -> None:
        """Publish `[b"", seq, payload]` (live=False: lost on the way, as a dropped message) and keep it for replays."""
        with self._lock:
            if live:
                self.pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])
            self.buffer.append((seq, payload))

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Until a subscriber's subscription has reached the pod: what is published before it is not delivered
        (ZMQ's slow joiner), however long a machine takes to get there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                try:
                    message = self.pub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    message = b""
            if message[:1] == b"\x01":
                return
            time.sleep(0.01)
        raise AssertionError("no subscription reached the pod")

    def send_frames(self, frames: list[bytes]) -> None:
        with self._lock:
            self.pub.send_multipart(frames)

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            try:
                identity, _, start = self.router.recv_multipart()
            except zmq.Again:
                continue
            time.sleep(self.replay_delay)
            with self._lock:
                for seq, payload in self.buffer:
                    if seq >= int.from_bytes(start, "big"):
                        self.router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"), payload])
                self.router.send_multipart([identity, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self.http.shutdown()
        for thread in self._threads:
            thread.join(2)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self._context.term()
