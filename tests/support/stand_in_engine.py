"""A stand-in engine (a fake: it fails in the ways the tests need, on purpose, where a real engine cannot be made to):
it answers /metrics and completions on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

METRICS = b"kvfleet_kv_cache_usage 0.1\nkvfleet_num_requests_waiting 0\nkvfleet_num_requests_running 0\n"


def error_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}}).encode()


class StandInEngine:
    """Answers by the prompt: `poison-500` an unmarked 500, `poison-400` a 400, `truncate` a stream cut short
    without [DONE]; anything else a normal completion. `broken` makes every completion a marked engine fault."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.broken = False
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.startswith("/metrics"):
                    self.answer(200, METRICS, "text/plain")
                else:
                    self.answer(200, b'{"object": "list", "data": [{"id": "stand-in", "object": "model"}]}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                prompt = body.get("prompt", "")
                engine.prompts.append(prompt)
                if engine.broken:
                    self.answer(500, error_body("the engine thread died"), fault=True)
                elif prompt == "poison-500":
                    self.answer(500, error_body("tokenizer exploded on this input"))
                elif prompt == "poison-400":
                    self.answer(400, error_body("prompt: not valid Unicode"))
                elif prompt == "truncate":
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("connection", "close")
                    self.end_headers()
                    self.wfile.write(b'data: {"choices": [{"index": 0, "text": "Once"}]}\n\n')
                    self.close_connection = True  # ends the body by closing: no [DONE], no error
                else:
                    self.answer(200, json.dumps({"object": "text_completion", "choices": [
                        {"index": 0, "text": "ok", "finish_reason": "length"}]}).encode())

            def answer(self, status: int, body: bytes, media: str = "application/json", fault: bool = False) -> None:
                self.send_response(status)
                self.send_header("content-type", media)
                self.send_header("content-length", str(len(body)))
                if fault:
                    self.send_header("x-kvfleet-fault", "engine")
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "stand-in", "prompt": prompt, **extra}, timeout=30)
