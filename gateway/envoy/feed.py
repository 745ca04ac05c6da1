"""What Envoy tells the picker about each request it carried: its access log entries, streamed over gRPC (Envoy's
access log service, buffered and flushed by Envoy), turned into the key's token settlement, the requests metric
with the real status, and the engine's outcome for ejection.

The picker gives each routed request a ticket in Envoy's dynamic metadata (never the client's x-request-id, which a
client may reuse); the Lua filter (envoy/lua.py) adds the answer's usage to the same metadata, and Envoy's entry
for the request carries both back. A request whose entry never comes (Envoy lost it) is settled at its
reservation ENTRY_WAIT_S after its ext_proc stream closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from dataclasses import dataclass

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.accesslog.v3.als_pb2_grpc import AccessLogServiceServicer
from google.protobuf.struct_pb2 import Struct

from kvfleet.gateway.engines.failure_class import classify_attempt, engine_health
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.envoy.bootstrap import ENGINES_CLUSTER
from kvfleet.gateway.envoy.eds import envoy_address
from kvfleet.gateway.envoy.lua import USAGE_NAMESPACE
from kvfleet.gateway.limits.usage import Settlement, Usage
from kvfleet.gateway.metrics import GatewayMetrics

log = logging.getLogger("kvfleet.gateway.envoy.feed")

ENTRY_WAIT_S = 30.0  # Envoy flushes its log every ACCESS_LOG_FLUSH_S; an entry this late is not coming
SWEEP_INTERVAL_S = 5.0
# the retries metric's reason for Envoy's retries (an attempt's entry does not say which request it belonged to, so
# the reason of the failed attempt is not joined to it; the Python proxy labels connect_error or status_<code>)
ENVOY_RETRY = "engine_fault"
CLIENT_CLOSED = 499  # the requests metric's code for a request whose client left before any answer


@dataclass
class Expected:
    """A routed request awaiting Envoy's entry: its class (the metric's label) and its token reservation."""

    priority: str
    settlement: Settlement | None
    metrics: GatewayMetrics  # its fleet's (one per model behind a ModelFront)
    closed_at: float | None = None  # monotonic time its ext_proc stream closed (the request ended in Envoy)


class EnvoyFeed(AccessLogServiceServicer):
    """Receives Envoy's access log stream in the picker's process and settles each request from its entry."""

    def __init__(self, pool: EndpointPool, metrics: GatewayMetrics, wait_s: float = ENTRY_WAIT_S):
        self.pool, self.metrics, self.wait_s = pool, metrics, wait_s
        self.expected: dict[str, Expected] = {}
        self._prefix = uuid.uuid4().hex[:8]  # a restarted picker never matches an entry meant for its predecessor
        self._numbers = itertools.count(1)
        self._sweeper: asyncio.Task | None = None
        self._urls: dict[str, str] = {}  # engine ip:port -> the pool's URL for it

    def expect(self, priority: str, settlement: Settlement | None, degraded: str | None = None,
               metrics: GatewayMetrics | None = None) -> tuple[str, Struct]:
        """A ticket for a request about to be routed, and the dynamic metadata that carries it (and tells the Lua
        filter whether to count the answer's tokens, hide the usage chunk only the gateway asked for, and mark the
        answer degraded). `metrics`: its fleet's, where the answer is counted (default: the feed's)."""
        ticket = f"{self._prefix}-{next(self._numbers)}"
        self.expected[ticket] = Expected(priority, settlement, metrics or self.metrics)
        fields: dict = {"ticket": ticket}
        if degraded is not None:
            fields["degraded"] = degraded
        if settlement is not None:
            fields["count_usage"] = True
            fields["hide_usage"] = settlement.hide_stream_usage
        metadata = Struct()
        metadata.update({USAGE_NAMESPACE: fields})
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="envoy feed sweeper")
        return ticket, metadata

    def closed(self, ticket: str) -> None:
        """The request's ext_proc stream closed: its entry is due within Envoy's flush interval."""
        expected = self.expected.get(ticket)
        if expected is not None:
            expected.closed_at = time.monotonic()

    async def StreamAccessLogs(self, request_iterator, context) -> als_pb2.StreamAccessLogsResponse:  # noqa: N802
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                self.record(entry)
        return als_pb2.StreamAccessLogsResponse()

    def record(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        """One entry: a request's end (settle, count) or one attempt at an engine (its outcome for ejection)."""
        common = entry.common_properties
        if common.access_log_type == accesslog_pb2.UpstreamEnd:
            self._record_attempt(common, entry.response)
            return
        fields = common.metadata.filter_metadata[USAGE_NAMESPACE].fields
        expected = self.expected.pop(fields["ticket"].string_value, None) if "ticket" in fields else None
        if expected is None:
            return
        status = entry.response.response_code.value
        flags = flag_names(common.response_flags)
        metrics = expected.metrics
        metrics.labelled(metrics.requests, expected.priority, str(status or CLIENT_CLOSED)).inc()
        if common.upstream_request_attempt_count > 1:  # Envoy retried on the fallback engine, after an engine fault
            metrics.retries.labels(ENVOY_RETRY).inc(common.upstream_request_attempt_count - 1)
        if expected.settlement is not None:
            _settle(expected.settlement, status, "DC" in flags, fields)

    def _record_attempt(self, common: accesslog_pb2.AccessLogCommon,
                        response: accesslog_pb2.HTTPResponseProperties) -> None:
        if common.upstream_cluster != ENGINES_CLUSTER:
            return
        address = common.upstream_remote_address.socket_address
        url = self._url_of(f"{address.address}:{address.port_value}") if address.address else None
        if url is None:
            return
        verdict = classify_attempt(response.response_code.value, flag_names(common.response_flags),
                                   {k.lower(): v for k, v in response.response_headers.items()})
        ok = engine_health(verdict)
        if ok is not None and self.pool.record_outcome(url, ok):
            log.warning("ejecting engine %s for %.0f s after repeated failures", url, self.pool.eject_seconds)
            self.metrics.ejections.labels(url).inc()

    def _url_of(self, address: str) -> str | None:
        """The pool's URL of an engine Envoy names by `ip:port` (the map is rebuilt when an address is new to it)."""
        if address not in self._urls:
            self._urls = {}
            for url in self.pool.urls():
                with contextlib.suppress(OSError):
                    self._urls[envoy_address(url)] = url
        return self._urls.get(address)

    def expire(self, now: float | None = None) -> int:
        """Settles at their reservation the requests whose entry is overdue; returns how many."""
        now = time.monotonic() if now is None else now
        overdue = [t for t, e in self.expected.items() if e.closed_at is not None and now - e.closed_at > self.wait_s]
        for ticket in overdue:
            expected = self.expected.pop(ticket)
            if expected.settlement is not None:
                expected.settlement.abandoned()
        if overdue:
            log.warning("Envoy sent no access log entry for %d requests; their token reservations stand",
                        len(overdue))
        return len(overdue)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.expire()

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for expected in self.expected.values():  # the entries died with Envoy: keep the reservations
            if expected.settlement is not None:
                expected.settlement.abandoned()
        self.expected.clear()


def flag_names(response_flags: accesslog_pb2.ResponseFlags) -> set[str]:
    """Envoy's short names (as in its text access log) of the set flags."""
    return {name for name, field in _FLAG_FIELDS.items() if getattr(response_flags, field)}


_FLAG_FIELDS = {"DC": "downstream_connection_termination", "DR": "downstream_remote_reset",
                "UF": "upstream_connection_failure", "UC": "upstream_connection_termination",
                "UR": "upstream_remote_reset", "UT": "upstream_request_timeout", "SI": "stream_idle_timeout",
                "UPE": "upstream_protocol_error", "UH": "no_healthy_upstream", "UO": "upstream_overflow",
                "URX": "upstream_retry_limit_exceeded", "LR": "local_reset", "NC": "no_cluster_found",
                "UMSDR": "upstream_max_stream_duration_reached"}


def _settle(settlement: Settlement, status: int, client_left: bool, fields) -> None:
    """The engine's count when the Lua filter found one in a success; else the Python proxy's rule for the outcome.
    The Lua filter's first token time (Envoy's wall clock, ms) becomes this process's monotonic time."""
    total = fields["total_tokens"].number_value if "total_tokens" in fields else None
    completion = int(fields["completion_tokens"].number_value) if "completion_tokens" in fields else None
    first_token_at = time.monotonic() - (time.time() - fields["first_token_ms"].number_value / 1000.0) \
        if "first_token_ms" in fields else None
    if status and not 200 <= status < 300:
        settlement.refund()  # refused or failed: nothing was generated
    elif total is not None and total >= 0:
        settlement(Usage(int(total), completion=completion, first_token_at=first_token_at))
    elif client_left:
        settlement.abandoned()  # the engine worked for a client that left: its count is unknown
    elif status:  # a success without a count: the whole reservation
        settlement(Usage(None, streamed_events=None, completion=completion, first_token_at=first_token_at))
    else:
        settlement.refund()  # no engine answered at all
