"""The gRPC server: servicers, health, reflection, transport options, start-up and draining."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from tokenloop.core.executor import Executor
from tokenloop.v1 import tokenloop_pb2

from . import logs, reflection
from .app import GENERATE_RPCS, App
from .config import ServerConfig
from .connections import ConnectionWatch, check_fd_limit, grpc_connection_options
from .corelog import CoreLogRelay
from .decoding import DecodingInterceptor
from .executors import default_executor_factory
from .frontdoor import add_service
from .logs import RequestLogInterceptor, RequestLogObserver
from .security import ApiKeyInterceptor, load_api_keys, server_credentials
from .servicer import TextGenerationServicer, add_text_generation
from .tracing import tracing_interceptor

log = logging.getLogger("tokenloop.service")


def interceptors(config: ServerConfig) -> list[grpc.aio.ServerInterceptor]:
    """Outermost first: the refusal of undecodable requests (outermost: it drives whatever handler the others
    made, see service.decoding), tracing (optional), the per-request log line, then API keys (when configured)."""
    out: list[grpc.aio.ServerInterceptor] = [DecodingInterceptor(own_checks=GENERATE_RPCS)]
    out += [i for i in (tracing_interceptor(config.otel_endpoint),) if i is not None]
    out.append(RequestLogInterceptor(own_records=GENERATE_RPCS))
    keys = load_api_keys(config.api_key_file)
    if config.api_key_file and not keys:  # never serve openly by mistake
        raise ValueError(f"--api-key-file {config.api_key_file} holds no API key")
    admin = load_api_keys(config.admin_key_file, env="") if config.admin_key_file else []
    if config.admin_key_file and not admin:
        raise ValueError(f"--admin-key-file {config.admin_key_file} holds no admin key")
    if keys or admin:
        out.append(ApiKeyInterceptor(keys, admin))
        log.info("API keys %s; management RPCs need an admin key (%s)",
                 f"required ({len(keys)} configured)" if keys else "not required",
                 f"{len(admin)} configured" if admin else "none configured: management RPCs are off")
    else:
        log.warning("no --api-key-file nor --admin-key-file: every RPC is open to every caller, management RPCs "
                    "(LoRA load and unload, FlushCache) included")
    return out


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Transport settings that tolerate routers' keepalive pings from idle connections, and the bounds on
    connections grpc core enforces (service.connections)."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.so_reuseport", 0),
        *grpc_connection_options(config.handshake_timeout, config.max_connections),
    ]


class Server:
    """One tokenloop server: `await start()`, then `await wait()` or `await stop()`."""

    def __init__(self, config: ServerConfig,
                 executor_factory: Callable[[ServerConfig], Executor] = default_executor_factory):
        self.config = config
        self.app = App(config, executor_factory)
        self.app.observers.append(RequestLogObserver())
        logs.FAILED_LINES.reset()  # a new server's failed-request lines start with the full burst
        self.grpc = grpc.aio.server(options=grpc_options(config), interceptors=interceptors(config))
        self.certificates = None  # security.CertificateReloader when serving TLS
        self.port = 0
        self.connections: ConnectionWatch | None = None  # the per-peer cap and the cap's log line (Linux)
        self.extra_services: list[str] = []
        self._stop = asyncio.Event()
        self._stop_now = asyncio.Event()  # a second SIGTERM/SIGINT: end the drain at once
        self.forced_by: int | None = None  # the signal that ended the drain early

    def _add_services(self) -> None:
        add_text_generation(TextGenerationServicer(self.app), self.grpc)
        add_service(self.grpc, self.app.health, health_pb2.DESCRIPTOR.services_by_name["Health"])
        names = [tokenloop_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        protocol = self.config.router_protocol  # smg's worker APIs (docs/router.md)
        try:
            if protocol in ("both", "trtllm"):
                from .trtllm_service import add_trtllm_service
                names.append(add_trtllm_service(self.app, self.grpc))
            if protocol in ("both", "vllm"):
                from .vllm_service import add_vllm_service
                names.append(add_vllm_service(self.app, self.grpc))
        except ImportError:  # no smg-grpc-proto
            pass
        reflection.enable(names, self.grpc)  # method symbols resolve too (grpcurl describe Service.Method)

    async def start(self) -> int:
        """Listen (health NOT_SERVING), load the model, start the looper, serve. Returns the port."""
        self._add_services()
        check_fd_limit(self.config.max_connections)
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert:
            creds, self.certificates = server_credentials(self.config.tls_cert, self.config.tls_key,
                                                          self.config.tls_client_ca)
            self.port = self.grpc.add_secure_port(address, creds)
        else:
            self.port = self.grpc.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.config.host}:{self.config.port}")
        await self.grpc.start()
        self._watch_connections()
        if self.config.metrics_port:
            from .metrics import start_metrics_server  # Prometheus /metrics
            start_metrics_server(self.app, self.config.host, self.config.metrics_port)
        await self.app.start()
        log.info("tokenloop ready: serving %s (backend %s) on %s:%d", self.app.card.model_id,
                 self.config.backend, self.config.host, self.port)
        return self.port

    def _watch_connections(self) -> None:
        c = self.config
        if not (c.max_connections or c.max_connections_per_peer):
            return
        if not ConnectionWatch.available():
            if c.max_connections_per_peer:
                log.warning("--max-connections-per-peer is not enforced here (no /proc/self/net/tcp)")
            return
        self.connections = ConnectionWatch(self.port, c.max_connections, c.max_connections_per_peer)
        self.connections.start()

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """SIGTERM/SIGINT: the first drains (Server.stop); the next one cancels what is left at once."""
        if not self._stop.is_set():
            self._stop.set()
        elif not self._stop_now.is_set():
            self.forced_by = signum
            self._stop_now.set()
            log.warning("%s again: stopping now; the requests left end UNAVAILABLE", signal.Signals(signum).name)

    def reload_certificates(self) -> None:
        """SIGHUP: read the TLS files again at the next handshake."""
        if self.certificates is not None:
            self.certificates.request_reload()

    async def wait(self) -> int:
        """Serve until a stop is requested (SIGTERM/SIGINT) or the executor dies; returns an exit code: 0 after a
        drain, 1 when the executor died, 128 + the signal's number when a second signal cut the drain short."""
        stop = asyncio.ensure_future(self._stop.wait())
        dead = asyncio.ensure_future(self.app.dead.wait())
        await asyncio.wait([stop, dead], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        dead.cancel()
        died = self.app.dead.is_set()
        await self.stop(grace=1.0 if died else self.config.shutdown_grace)
        if self.forced_by is not None:
            return 128 + self.forced_by
        return 1 if died and self.config.exit_on_engine_death else 0

    async def stop(self, grace: float | None = None) -> None:
        """Drain in-flight requests within `grace` seconds (a second signal: none), fail the rest, close everything.
        Compiles in progress are killed at once (App.drain)."""
        grace = self.config.shutdown_grace if grace is None else grace
        num_open = self.app.looper.num_open if self.app.looper is not None else 0
        log.info("draining: up to %.1fs for %d in-flight requests; press Ctrl-C again (or send SIGTERM) to stop now",
                 grace, num_open)
        await self.app.drain(grace, self._stop_now)
        await self.grpc.stop(0 if self._stop_now.is_set() else 1.0)
        if self.connections is not None:
            self.connections.stop()
        if self.config.metrics_port:
            from .metrics import stop_metrics_server
            stop_metrics_server(self.app)
        await asyncio.to_thread(self.app.close)
        log.info("stopped")


async def run(config: ServerConfig) -> int:
    """Run a server until SIGTERM/SIGINT; exit code 0 after a drain, 2 when it cannot start, 128 + the signal's
    number (130 for SIGINT, 143 for SIGTERM) when a second signal stopped it at once (Server.wait)."""
    try:
        server = Server(config)
    except (OSError, ValueError) as exc:  # an unreadable or empty API key file
        log.error("start-up failed: %s", exc)
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop, sig)
    loop.add_signal_handler(signal.SIGHUP, server.reload_certificates)
    relay = CoreLogRelay()  # gRPC core's stderr: failed TLS handshakes rate-limited, its INFO lines unless asked
    relay.start()
    try:
        try:
            await server.start()
        except Exception as exc:
            log.error("start-up failed: %s", exc)
            await server.grpc.stop(0)
            return 2
        return await server.wait()
    finally:
        relay.stop()
