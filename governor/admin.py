"""The operator's HTTP listener (``metrics_listen``), served by a thread of its own.

    GET  /metrics        Prometheus text, collected on the event loop (503 if it does not answer)
    GET  /healthz/live   200 or 503, JSON: computed here, off the loop (:mod:`governor.health`)
    GET  /healthz/ready  200 or 503, JSON: computed on the loop; a loop that does not answer
                         within a second is not ready
    POST /drain[?wait=S] from a loopback address only: start the graceful drain, then wait up
                         to S seconds for running jobs; 200 with ``{"drained": ...}``

Why a thread: a liveness probe served on the event loop cannot tell a blocked loop from a
slow network; it just gets no answer. Served here, it answers 503 and says how long the loop
has been stalled. Everything that reads the server's state beyond the heartbeat is handed to
the loop with ``run_coroutine_threadsafe``, so the daemon's state has one writer and one reader.

POST /drain is what a Kubernetes preStop hook calls (``governor drain``): only from loopback,
because the listener is usually bound to every interface for the kubelet and Prometheus.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .exporter import registry_for
from .health import Health
from .state import ServerState

log = logging.getLogger("governor.admin")

T = TypeVar("T")
METRICS_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 1.0
REQUEST_TIMEOUT_S = 5.0  # a client that cannot send its request head in time is dropped
MAX_DRAIN_WAIT_S = 600.0
JSON = "application/json"


class LoopStalled(Exception):
    """The event loop did not run the call in time."""


# POST /drain: begin the drain, then wait up to that many seconds; returns the jobs still running.
Drain = Callable[[float], Coroutine[Any, Any, int]]


class AdminListener:
    def __init__(
        self,
        state: ServerState,
        health: Health,
        drain: Drain,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.health = health
        self.drain = drain
        self.loop = loop
        self.registry = registry_for(state, health)
        self._httpd: ThreadingHTTPServer | None = None

    def start(self, host: str, port: int) -> None:
        listener = self

        class Handler(_Handler):
            admin = listener

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        httpd_class = type("AdminHTTPServer", (ThreadingHTTPServer,), {"address_family": family})
        self._httpd = httpd_class((host, port), Handler)
        threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="governor-admin",
            daemon=True,
        ).start()

    @property
    def address(self) -> tuple[str, int]:
        assert self._httpd is not None
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    async def close(self) -> None:
        if self._httpd is not None:
            await asyncio.to_thread(self._httpd.shutdown)
            self._httpd.server_close()

    def on_loop(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float) -> T:
        """Run the coroutine ``make()`` on the event loop; its result, from this thread."""
        coro = make()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            raise LoopStalled from None
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise LoopStalled from None


async def _call(fn: Callable[[], T]) -> T:
    return fn()


class _Handler(BaseHTTPRequestHandler):
    admin: AdminListener
    timeout = REQUEST_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        admin = self.admin
        health = admin.health
        if path == "/metrics":
            try:
                body = admin.on_loop(
                    lambda: _call(lambda: generate_latest(admin.registry)), METRICS_TIMEOUT_S
                )
            except LoopStalled:
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "the event loop is stalled"})
            else:
                self._send(HTTPStatus.OK, CONTENT_TYPE_LATEST, body)
        elif path == "/healthz/live":
            verdict = health.liveness()
            self._verdict(verdict.ok, verdict.body())
        elif path == "/healthz/ready":
            try:
                verdict = admin.on_loop(lambda: _call(health.readiness), READY_TIMEOUT_S)
            except LoopStalled:
                stalled = {
                    "status": "fail",
                    "checks": {
                        "event_loop": {
                            "ok": False,
                            "detail": f"the event loop did not answer within {READY_TIMEOUT_S:g} s",
                        }
                    },
                }
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, stalled)
            else:
                self._verdict(verdict.ok, verdict.body())
        else:
            self._json(
                HTTPStatus.NOT_FOUND,
                {"error": "not found", "try": ["/metrics", "/healthz/live", "/healthz/ready"]},
            )

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/drain":
            self._json(HTTPStatus.NOT_FOUND, {"error": "not found", "try": ["/drain"]})
            return
        if not _is_loopback(self.client_address[0]):
            self._json(HTTPStatus.FORBIDDEN, {"error": "POST /drain is taken from loopback only"})
            return
        try:
            wait = float(urllib.parse.parse_qs(url.query).get("wait", ["0"])[0])
        except ValueError:
            self._json(HTTPStatus.BAD_REQUEST, {"error": "wait must be a number of seconds"})
            return
        wait = min(max(wait, 0.0), MAX_DRAIN_WAIT_S)
        try:
            inflight = self.admin.on_loop(lambda: self.admin.drain(wait), wait + READY_TIMEOUT_S)
        except LoopStalled:
            self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "the event loop is stalled"})
            return
        self._json(
            HTTPStatus.OK, {"draining": True, "drained": inflight == 0, "inflight": inflight}
        )

    # Replies -----------------------------------------------------------------------------

    def _verdict(self, ok: bool, body: bytes) -> None:
        self._send(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, JSON, body)

    def _json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        self._send(status, JSON, orjson.dumps(body))

    def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
