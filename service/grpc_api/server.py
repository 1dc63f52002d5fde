"""The gRPC door: a grpc.aio server with its interceptors (tracing, auth, errors), the Generation and Adapters
servicers, health, and server reflection (v1 and v1alpha, reflection.py). The process (both doors, warm-up,
drain) is wired in service/server.py."""
from __future__ import annotations

from collections.abc import Callable

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service._proto import pb, pb_grpc
from service.connections import ConnectionLimits
from service.front import RequestFront
from service.front.chat_template import ChatTemplate
from service.grpc_api.interceptors import ErrorInterceptor
from service.grpc_api.reflection import enable_reflection
from service.grpc_api.security import AuthInterceptor
from service.grpc_api.servicers import AdaptersServicer, GenerationServicer
from service.lifecycle import ServingState
from service.limits import RequestLimits
from service.security import SecurityConfig, TlsConfig
from service.telemetry.interceptor import TracingInterceptor

SERVICE_NAMES = tuple(s.full_name for s in pb.DESCRIPTOR.services_by_name.values())


class GrpcServer:
    """bind() → start() → (set_serving) → stop(). Health answers NOT_SERVING until set_serving(True)."""

    def __init__(self, front: RequestFront, *, limits: RequestLimits, security: SecurityConfig,
                 connections: ConnectionLimits, replica_id: str, state: Callable[[], ServingState], doors: int,
                 tracing: TracingInterceptor | None = None, chat_template: ChatTemplate | None = None):
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        tracers = [tracing] if tracing is not None else []
        self._server = grpc.aio.server(
            # Tracing first (outermost): its server span also covers refusals by the others; its inner part last.
            interceptors=[*tracers, AuthInterceptor(security), ErrorInterceptor(state), *(t.inner for t in tracers)],
            options=[("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
                     ("grpc.max_receive_message_length", limits.max_message_bytes),
                     *([("grpc.max_concurrent_streams", limits.max_streams_per_connection)]
                       if limits.max_streams_per_connection else []),
                     *connections.grpc_options(doors=doors)],
        )
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(front, replica_id, chat_template), self._server)
        pb_grpc.add_AdaptersServicer_to_server(AdaptersServicer(front), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        enable_reflection((*SERVICE_NAMES, health.SERVICE_NAME), self._server)

    def bind(self, host: str, port: int, tls: TlsConfig | None) -> int:
        """Listen on host:port (0: any free port); returns the port. OSError when it cannot be bound."""
        address = f"{host}:{port}"
        self.port = (self._server.add_secure_port(address, tls.server_credentials()) if tls
                     else self._server.add_insecure_port(address))
        if not self.port:
            raise OSError(f"cannot bind {address}")
        return self.port

    async def start(self) -> None:
        await self.set_serving(False)
        await self._server.start()

    async def set_serving(self, serving: bool) -> None:
        """Health of the server ("") and of each loraserve.v1 service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def enter_graceful_shutdown(self) -> None:
        """Health says NOT_SERVING from now on, whatever is set later."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float | None = None) -> None:
        await self._server.stop(grace=grace_s)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
