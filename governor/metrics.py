"""Prometheus metrics, and the small HTTP endpoint that serves them.

Values are read from the server's own state at scrape time, so the admission path pays
nothing for them. Labels are bounded: wire codes only, never a job id.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .policy import LANES

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger("governor.metrics")

MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT_S = 5.0


class GovernorCollector(Collector):
    def __init__(self, server: Server) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        server, ledger = self.server, self.server.ledger
        gauges = (
            ("governor_inflight", "Jobs executing now.", ledger.inflight),
            ("governor_inflight_cap", "The hard cap on executing jobs (max_inflight).", ledger.cap),
            ("governor_inflight_peak", "Highest inflight since start.", ledger.peak_inflight),
            ("governor_health", "1 when a job would be admitted now, else 0.", int(ledger.ready)),
            ("governor_draining", "1 while shutting down.", int(ledger.draining)),
            ("governor_connections", "Open client connections.", len(server.connections)),
            (
                "governor_buffered_payload_bytes",
                "Payload bytes reserved by uploads in progress and payloads held after a yield.",
                server.buffered_bytes,
            ),
            (
                "governor_expected_service_seconds",
                "The service-time estimate behind retry hints.",
                ledger.service_s,
            ),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        yield CounterMetricFamily(
            "governor_executed", "Jobs admitted to execute.", value=ledger.executed_total
        )
        yield CounterMetricFamily(
            "governor_yielded",
            "Admission attempts answered with yield.",
            value=ledger.yielded_total,
        )
        outcomes = CounterMetricFamily(
            "governor_jobs_finished", "Admitted jobs that ended, by outcome.", labels=["outcome"]
        )
        for outcome, count in sorted(server.outcomes.items()):
            outcomes.add_metric([outcome], count)
        yield outcomes
        refusals = CounterMetricFamily(
            "governor_refusals",
            "Admission attempts refused with yield, by need code, lane ('-': no lane policy) "
            "and tenant.",
            labels=["code", "lane", "tenant"],
        )
        for (code, lane, tenant), count in sorted(server.refusals.items()):
            refusals.add_metric([code, lane, tenant], count)
        yield refusals
        tenants = GaugeMetricFamily(
            "governor_tenant_inflight", "Jobs executing now, by tenant.", labels=["tenant"]
        )
        for t in server.tenants.all():
            tenants.add_metric([t.name], t.inflight)
        yield tenants
        if ledger.policy is not None:
            lanes = GaugeMetricFamily(
                "governor_lane_inflight", "Jobs executing now, by lane.", labels=["lane"]
            )
            for lane in LANES:
                lanes.add_metric([lane], ledger.lane_inflight[lane])
            yield lanes
            yield GaugeMetricFamily(
                "governor_kv_reserved_tokens",
                "KV cache tokens reserved by running jobs (prompt + max_new_tokens).",
                value=ledger.kv_reserved,
            )
            yield GaugeMetricFamily(
                "governor_kv_capacity_tokens",
                "The KV budget's capacity (0: no budget).",
                value=ledger.policy.kv_capacity,
            )
        if server.overload is not None:
            yield GaugeMetricFamily(
                "governor_overload_state",
                "0 normal, 1 degraded, 2 batch_paused, 3 interactive_only.",
                value=int(server.overload.state),
            )
            moves = CounterMetricFamily(
                "governor_overload_transitions", "Overload state changes.", labels=["from", "to"]
            )
            for (before, after), count in sorted(server.overload.transitions.items()):
                moves.add_metric([before, after], count)
            yield moves
        ladder = CounterMetricFamily(
            "governor_fallback_activations",
            "Fallback ladder steps taken, by step.",
            labels=["step"],
        )
        for step, count in sorted(server.ladder.items()):
            ladder.add_metric([step], count)
        yield ladder
        bad = CounterMetricFamily(
            "governor_bad_frames", "Lines refused before any upload, by need code.", labels=["code"]
        )
        for code, count in sorted(server.bad_frames.items()):
            bad.add_metric([code], count)
        yield bad


class MetricsEndpoint:
    """``GET /metrics`` over HTTP/1.1 on the event loop itself, one request per connection."""

    def __init__(self, server: Server) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(GovernorCollector(server))
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(
            self._handle, host, port, limit=MAX_REQUEST_HEAD, reuse_address=True
        )

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        assert self._server.sockets
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            if method not in (b"GET", b"HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == b"/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"try /metrics\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            )
            if method != b"HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a client that cannot send a request head gets nothing
        finally:
            writer.close()
