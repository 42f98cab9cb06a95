"""What every Tessera service process shares: an event loop in a thread, ports, /metrics, health.

A Ray actor is a plain (synchronous) object; its gRPC server runs on an asyncio loop in a daemon
thread of the actor's process (``LoopThread``), so actor methods (address, ping, stop) never wait
on a busy loop. A restarted actor binds the port it had before (kept in Ray's internal KV under
its name), so peers holding its address reconnect without being told.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from typing import Any

import grpc

# Reconnect backoff capped at 1 s (gRPC's default grows to 120 s): a channel to a worker that Ray is
# restarting on the same address fails calls fast while it is down and reconnects within a second of
# its return, instead of failing every retry until a long backoff ends.
GRPC_OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20),
                ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1_000)]
PART_BYTES = 1 << 20          # bulk payloads travel in ~1 MiB messages


class LoopThread:
    """An asyncio loop running forever in a daemon thread; ``run(coro)`` waits for a result."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine, timeout: float | None = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def advertised_host(bind_host: str) -> str:
    """The host peers should dial: the bind address, or this node's IP when bound to all interfaces."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return socket.gethostbyname(socket.gethostname())


def _kv():
    try:
        import ray
        from ray.experimental import internal_kv

        if ray.is_initialized() and internal_kv._internal_kv_initialized():
            return internal_kv
    except Exception:  # noqa: BLE001 - outside Ray: no memory across restarts
        pass
    return None


def remembered_port(name: str, host: str, requested: int) -> int:
    """The port to bind: ``requested`` if given, else the one this named service had before a
    restart when it is still free, else 0 (any)."""
    if requested:
        return requested
    kv = _kv()
    if kv is None:
        return 0
    old = kv._internal_kv_get(f"tessera/port/{name}")
    if old:
        port = int(old)
        try:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
            return port
        except OSError:
            return 0
    return 0


def remember_port(name: str, port: int) -> None:
    kv = _kv()
    if kv is not None:
        kv._internal_kv_put(f"tessera/port/{name}", str(port).encode(), overwrite=True)


def forget_ports(prefix: str = "tessera/port/") -> None:
    """Drop remembered values under ``prefix`` (ports, registered chunk ids) before a fresh start."""
    kv = _kv()
    if kv is not None:
        for key in kv._internal_kv_list(prefix):
            kv._internal_kv_del(key)


class RayKV:
    """Small values in Ray's internal KV under a prefix; a no-op outside Ray."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def put(self, key: str, value: bytes) -> None:
        kv = _kv()
        if kv is not None:
            kv._internal_kv_put(f"{self.prefix}{key}", value, overwrite=True)

    def get(self, key: str) -> bytes | None:
        kv = _kv()
        return None if kv is None else kv._internal_kv_get(f"{self.prefix}{key}")


def serve_metrics(registry, host: str, port: int = 0) -> tuple[object, int]:
    """/metrics over HTTP on ``port`` (0: a free one; any other path: 404), served from a daemon thread;
    returns (server, port). ``server.shutdown()`` stops it and releases the port."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
    from wsgiref.simple_server import make_server as wsgi_server

    from prometheus_client import ProcessCollector, make_wsgi_app

    try:        # the process's CPU seconds, memory and open files (process_*), beside the service's own
        ProcessCollector(registry=registry)
    except ValueError:      # this registry has them already (served before)
        pass
    metrics_app = make_wsgi_app(registry)

    # NOTE: prometheus_client's own server answers every path with the metrics; only /metrics is ours
    def app(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: the metrics are at /metrics\n"]
        return metrics_app(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format, *args) -> None:     # a scrape is not worth a stderr line
            pass

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]   # IPv4 or IPv6 host

        def shutdown(self) -> None:
            super().shutdown()
            self.server_close()      # callers only shut down: the listening socket goes with it

    server = wsgi_server(host, port, app, server_class=Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name=f"metrics-http-{server.server_port}", daemon=True).start()
    return server, server.server_port


class MetricsEndpoint:
    """``serve_http``/``stop_http`` for a service's metrics object (one holding a prometheus ``registry``)."""

    _http = None

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose /metrics on ``addr:port`` (0 picks a free port; any other path: 404); returns the port."""
        self._http, port = serve_metrics(self.registry, addr, port)
        return port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http = None


async def add_health(server: grpc.aio.Server, service_names: tuple[str, ...]):
    """Health (every name SERVING once started) and reflection on ``server``; returns the servicer."""
    from grpc_health.v1 import health, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return servicer


async def set_serving(servicer, service_names: tuple[str, ...], serving: bool) -> None:
    from grpc_health.v1 import health_pb2

    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await servicer.set(name, status)


class StoppedForGood:
    """A worker's answer to its engine loop stopping for good, called from that loop's thread: on the event loop,
    NOT_SERVING (once ``health`` is set: the server's health servicer), then ``on_fatal()`` (a Ray actor exits
    there, and Ray restarts it)."""

    def __init__(self, service_names: tuple[str, ...], on_fatal=None) -> None:
        self.service_names, self.on_fatal = service_names, on_fatal
        self.loop = asyncio.get_running_loop()
        self.health = None

    def __call__(self, _exc: BaseException) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop)

    async def _stop(self) -> None:
        import logging

        if self.health is not None:
            await set_serving(self.health, self.service_names, False)
        logging.getLogger(__name__).critical("%s: NOT_SERVING, the engine loop stopped", ", ".join(self.service_names))
        if self.on_fatal is not None:
            self.on_fatal()


def make_server(where: str, cluster_tls=None, interceptors=()) -> grpc.aio.Server:
    """A grpc.aio server whose handlers pass ``RoleGuard`` (services/cluster/guard.py): callers' roles checked
    when ``cluster_tls`` (a ``ClusterTLS``) is given, a handler's unexpected error turned into INTERNAL with
    an id. ``interceptors`` run before it (the gateway's bearer tokens)."""
    from services.cluster.guard import RoleGuard

    return grpc.aio.server(options=GRPC_OPTIONS,
                           interceptors=[*interceptors, RoleGuard(where, authorize=cluster_tls is not None)])


def channel(address: str, peer_role: str, cluster_tls=None, options=GRPC_OPTIONS) -> grpc.aio.Channel:
    """An asyncio channel to the ``peer_role`` service at ``address``: over mutual TLS with ``cluster_tls``
    (the server must prove that role), else plain."""
    if cluster_tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, cluster_tls.channel_credentials(),
                                   options=[*options, *cluster_tls.channel_options(peer_role)])


def bind(server: grpc.aio.Server, host: str, port: int, tls: tuple[bytes, bytes] | None = None,
         cluster_tls=None) -> int:
    """Listen on host:port (0: any); with ``tls`` = (certificate chain PEM, private key PEM), over TLS (the
    client API); with ``cluster_tls`` (a ``ClusterTLS``), over mutual TLS with the cluster's certificates."""
    if tls is not None and cluster_tls is not None:
        raise ValueError("a port serves either the client API's TLS or the cluster's mutual TLS")
    if cluster_tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", cluster_tls.server_credentials())
    elif tls is not None:
        creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise ValueError(f"cannot listen on {host}:{port}")
    return bound
