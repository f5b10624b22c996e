"""`grpc.health.v1.Health` next to the VllmEngine service, as vLLM's gRPC server adds it for
Kubernetes probes and routers: "" (the server, liveness) and "vllm.grpc.engine.VllmEngine"
(readiness) are SERVING while the engine runs, NOT_SERVING once shutdown began or the engine
stopped; another service name is NOT_FOUND on Check and SERVICE_UNKNOWN on Watch."""

from __future__ import annotations

from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ENGINE_SERVICE = "vllm.grpc.engine.VllmEngine"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class EngineHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.shutting_down = False

    def status_of(self, service: str) -> int | None:
        if service not in ("", ENGINE_SERVICE):
            return None
        if self.shutting_down or not self.engine.is_running:
            return NOT_SERVING
        return SERVING

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self.status_of(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"Unknown service: {request.service}")
            return health_pb2.HealthCheckResponse(status=SERVICE_UNKNOWN)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        status = self.status_of(request.service)
        yield health_pb2.HealthCheckResponse(status=SERVICE_UNKNOWN if status is None else status)
