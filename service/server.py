"""The serving process above both doors: one runner, the request front both doors hold (front/), the gRPC door
(grpc_api/) and the HTTP door (http_api/) on one event loop, what observes the runner (tracing, /metrics, the
access log, the stats line), warm-up, and graceful drain. Neither door imports the other, nor the runner; this
module wires them."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_compile import Engine
from service.connections import ConnectionLimits, raise_open_files_limit
from service.front.chat_template import load_chat_template
from service.front.front import RequestFront
from service.grpc_api.server import GrpcServer
from service.http_api.app import HttpDoor, create_app
from service.http_api.server import HttpServer
from service.lifecycle import ServingState
from service.limits import RequestLimits
from service.runner.engine_runner import EngineRunner
from service.runner.observer_group import ObserverGroup
from service.security import SecurityConfig
from service.telemetry.access_log import AccessLog
from service.telemetry.http_tracing import HttpTracer
from service.telemetry.interceptor import TracingInterceptor
from service.telemetry.observer import TelemetryObserver
from service.telemetry.prometheus import PrometheusMetrics
from service.telemetry.prometheus_names import DEFAULT_METRICS_PREFIX
from service.telemetry.setup import Telemetry
from service.telemetry.stats_logger import StatsLogger

log = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 8000


def default_replica_id() -> str:
    """<hostname>-<pid>: unique among replicas on one host or in one cluster (a pod's hostname is its name)."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class LogConfig:
    """What the server logs as it serves (vLLM's defaults: both lines on, stats every 10 s)."""

    access_log: bool = True               # a line per HTTP request (telemetry/access_log.py)
    access_log_skip_paths: tuple[str, ...] = ()  # paths left out of it, e.g. ("/health", "/metrics")
    log_stats: bool = True                # the periodic stats line (telemetry/stats_logger.py)
    stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.stats_interval_s > 0:
            raise ValueError(f"the stats interval must be more than 0 seconds, got {self.stats_interval_s}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"     # "0.0.0.0" / "[::]" to accept remote clients (e.g. in a container)
    port: int = 50051           # 0: any free port (see LoraServer.port)
    grace_period_s: float = 30.0  # drain: how long in-flight streams may take to finish
    limits: RequestLimits = RequestLimits()      # queue, prompt / new tokens, streams, message size, slow readers
    security: SecurityConfig = SecurityConfig()  # tokens, adapter management, TLS (both doors)
    connections: ConnectionLimits = ConnectionLimits()  # open connections, idle / header timeouts (both doors)
    # The OpenAI-compatible HTTP door on `host` (service/http_api/); None: off, 0: any free port.
    # (`lora-serve --http-port` defaults to DEFAULT_HTTP_PORT; 0 there means off.)
    http_port: int | None = None
    # Names this process behind a balancer: x-replica-id on every Generate, OTEL service.instance.id.
    replica_id: str = field(default_factory=default_replica_id)
    # /metrics names: "lora_serve" (ours) or "vllm" (vLLM's names and label values; telemetry/prometheus_names.py)
    metrics_prefix: str = DEFAULT_METRICS_PREFIX
    # Per-adapter series of /metrics (lora_adapter_resident): at most this many, the rest counted in one
    # adapter="other" series per tier, as vLLM's max_loras bounds its label sets.
    max_adapter_metric_series: int = 64
    # The names the base model answers to and is reported under (the first); empty: its directory's name.
    served_model_names: tuple[str, ...] = ()
    logs: LogConfig = LogConfig()
    # How tool_choice "auto" reads the model's calls (service/http_api/tool_calls.py); None: "auto" is refused.
    tool_call_parser: str | None = None
    chat_template: str | None = None  # --chat-template FILE: instead of the model's (vLLM's flag)

    def __post_init__(self) -> None:
        if any(not name or not name.isprintable() for name in self.served_model_names):
            raise ValueError(f"a served model name must be a non-empty printable string, got "
                             f"{list(self.served_model_names)}")


class LoraServer:
    """start() → warmup() → (serving) → drain() → stopped. Health is NOT_SERVING except while serving."""

    def __init__(self, engine: Engine, config: ServerConfig = ServerConfig(), telemetry: Telemetry | None = None):
        self.config = config
        self.telemetry = telemetry  # None: tracing off (see telemetry/setup.py)
        self.state = ServingState.WARMING_UP
        self.runner = EngineRunner(engine, config.limits, served_model_names=config.served_model_names)
        self.front = RequestFront(self.runner, config.limits)  # both doors' one way to the runner
        info = self.runner.model_info()
        # Tracing on: the observer builds request and step spans from what the runner and the interceptor report.
        self.observer = (TelemetryObserver(telemetry, info.model, self.runner.is_adapter_known,
                                            adapter_tiers=self.runner.adapter_tiers)
                         if telemetry is not None else None)
        # /metrics (the HTTP door): gauges read from the runner when scraped, counters fed like the observer.
        self.metrics = (PrometheusMetrics(self.runner.stats, info.model, info.max_seq_len, config.metrics_prefix,
                                          config.max_adapter_metric_series)
                        if config.http_port is not None else None)
        logs = config.logs
        self.access_log = (AccessLog(logs.access_log_skip_paths)
                           if config.http_port is not None and logs.access_log else None)
        self.stats_logger = (StatsLogger(self.runner.stats, info.device, logs.stats_interval_s)
                             if logs.log_stats else None)
        observers = [o for o in (self.observer, self.metrics, self.access_log, self.stats_logger) if o is not None]
        self.runner.observer = observers[0] if len(observers) == 1 else ObserverGroup(observers) if observers else None
        # One chat template for both doors (--chat-template, else the model's).
        self.chat_template = load_chat_template(self.runner.model_dir, config.chat_template)
        self.grpc = GrpcServer(
            self.front, chat_template=self.chat_template, limits=config.limits, security=config.security,
            connections=config.connections, replica_id=config.replica_id, state=lambda: self.state,
            doors=self.doors, tracing=TracingInterceptor(telemetry, self.observer) if telemetry is not None else None)
        self.port: int | None = None
        self._stopped = False
        self.http: HttpServer | None = None
        self.http_port: int | None = None

    @property
    def health(self):
        """The gRPC health servicer (grpc.health.v1)."""
        return self.grpc.health

    def _http_door(self) -> HttpServer:
        """The OpenAI-compatible door: the same request front (capacity, validation, limits), tokens and TLS."""
        door = HttpDoor(
            front=self.front, security=self.config.security,
            state=lambda: self.state, metrics=self.metrics, max_body_bytes=self.config.limits.max_message_bytes,
            chat_template=self.chat_template, tool_call_parser=self.config.tool_call_parser,
            tracer=HttpTracer(self.telemetry, self.observer) if self.telemetry is not None else None,
            replica_id=self.config.replica_id, host=self.config.host)
        if door.chat_template is None:
            log.info("the model has no chat template: /v1/chat/completions answers 400")
        app = create_app(door)
        if self.access_log is not None:  # outermost: it sees every answer, refusals and 500s included
            app = self.access_log.wrap(app)
        return HttpServer(app, self.config.host, self.config.http_port, self.config.security.tls,
                          self.config.connections)

    @property
    def doors(self) -> int:
        """Listening doors, which share the file-handle budget: gRPC, and HTTP when on."""
        return 1 + (self.config.http_port is not None)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> int:
        """Bind and accept calls (health answers NOT_SERVING until warm-up is done). Returns the gRPC port."""
        self.port = self.grpc.bind(self.config.host, self.config.port, self.config.security.tls)
        await self.runner.start()
        await self.grpc.start()
        if self.stats_logger is not None:
            self.stats_logger.start()
        if self.config.http_port is not None:
            self.http = self._http_door()
            try:
                self.http_port = await self.http.start()
            except BaseException:
                await self.stop()
                raise
        return self.port

    async def warmup(self) -> float:
        """Compile every graph variant (in the engine thread), then report SERVING."""
        t0 = time.perf_counter()
        await self.runner.warmup()
        # What start-up made (modules, compiled graphs, protobuf descriptors) lives as long as the process:
        # frozen, it is out of the collector's reach, so a later full collection (a stall of every stream,
        # as long as the one timed here) walks only what serving allocates.
        # Once per process: what a later server in the same process (tests) leaves behind must stay collectable.
        if gc.get_freeze_count() == 0:
            t_gc = time.perf_counter()
            gc.collect()
            gc.freeze()
            log.info("warm-up: %d objects moved out of the garbage collector's reach (a full collection took "
                     "%.0f ms)", gc.get_freeze_count(), 1000 * (time.perf_counter() - t_gc))
        self.state = ServingState.SERVING
        await self.grpc.set_serving(True)
        return time.perf_counter() - t0

    async def drain(self, grace_period_s: float | None = None) -> bool:
        """Refuse new calls (UNAVAILABLE), let in-flight streams finish within the grace period, stop.
        Returns True if every stream finished on its own (the rest end with finish_reason CANCELLED)."""
        grace = self.config.grace_period_s if grace_period_s is None else grace_period_s
        self.state = ServingState.DRAINING
        await self.grpc.enter_graceful_shutdown()
        clean = await self.runner.drain(grace)
        await self.stop(grace_s=1.0)  # the last messages are queued; let them reach the clients
        return clean

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop now (or after `grace_s` for calls already answered); in-flight requests fail with UNAVAILABLE."""
        if self._stopped:
            return
        self._stopped = True
        self.state = ServingState.DRAINING
        await self.grpc.enter_graceful_shutdown()
        await self.grpc.stop(grace_s)
        await self.runner.shutdown()  # ends what the HTTP door still streams, then its connections close
        if self.http is not None:
            await self.http.stop()
        if self.stats_logger is not None:
            await self.stats_logger.stop()

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()


async def serve(engine: Engine, config: ServerConfig, on_ready: Callable[[LoraServer], None] | None = None,
                telemetry: Telemetry | None = None) -> bool:
    """Run until SIGTERM/SIGINT, then drain. Returns True if the drain was clean."""
    before, after = raise_open_files_limit()  # (before the doors derive their connection caps from it)
    if after > before:
        log.info("file-handle limit raised from %d to %d (the hard limit)", before, after)
    server = LoraServer(engine, config, telemetry)
    await server.start()
    if config.security.management_is_open() and config.host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        log.warning("adapter management (LoadAdapter/UnloadAdapter) is open to anyone who can reach %s; "
                    "set --admin-token or --disable-adapter-management", server.address)
    log.info("connections: %s", config.connections.describe(server.doors))
    if warning := config.connections.overcommitted(server.doors):
        log.warning("%s", warning)
    compiling = " (compiling the model's graphs; a cold start can take minutes)"
    log.info("listening on %s; warming up%s...", server.address, compiling if server.runner.model_info().compiled else "")
    try:
        seconds = await server.warmup()
    except BaseException:
        await server.stop()  # do not leave a half-started server behind
        raise
    log.info("warm-up done in %.1fs", seconds)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("lora-serve ready on %s (gRPC)%s", server.address,
             f" and http{'s' if config.security.tls else ''}://{config.host}:{server.http_port} (OpenAI-compatible HTTP)"
             if server.http_port else "")
    if on_ready is not None:
        on_ready(server)
    await stop.wait()
    log.info("draining: refusing new calls, waiting up to %.0fs for %d running and %d waiting requests",
             config.grace_period_s, server.runner.num_running, server.runner.num_waiting)
    clean = await server.drain()
    log.info("drained %s; bye", "cleanly" if clean else "(grace period over; the rest were cancelled)")
    return clean
