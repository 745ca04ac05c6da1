"""The operator's scrapes never hold its event loop: slow engine pods are read concurrently, and kopf's other
work (watches, other fleets' timers, the liveness probe) runs meanwhile."""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading
import time

import httpx
import pytest

from kvfleet.operator.autoscaler import PodLoad
from kvfleet.operator.observe import scrape_pod

DELAY_S = 1.5  # each pod's /metrics answers this late


@pytest.fixture(scope="module")
def slow_pod_url():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            time.sleep(DELAY_S)
            body = b"kvfleet_kv_cache_usage 0.5\nkvfleet_num_requests_running 2\nkvfleet_num_requests_waiting 1\n"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_four_slow_pods_are_scraped_while_the_loop_keeps_running(slow_pod_url: str, caplog) -> None:
    async def scrape_four() -> list[PodLoad]:
        asyncio.get_running_loop().slow_callback_duration = DELAY_S / 2  # debug mode logs any longer step
        async with httpx.AsyncClient(timeout=10) as http:
            return await asyncio.gather(*(scrape_pod(http, slow_pod_url) for _ in range(4)))

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        loads = asyncio.run(scrape_four(), debug=True)
    assert loads == [PodLoad(0.5, 2, 1)] * 4
    assert not [r for r in caplog.records if "took" in r.getMessage()], "a scrape blocked the event loop"
