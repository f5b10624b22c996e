"""The grpc.aio server of `serve --grpc`, on serve's event loop, with the channel options vLLM's
launcher sets (unbounded messages; keepalive pings tolerated while a non-streaming Generate
writes nothing)."""

from __future__ import annotations

from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2_grpc

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10000),
    ("grpc.keepalive_permit_without_calls", True),
    ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener
]


class GrpcServer:
    """Bound at construction (a clash is reported before the engine starts), started later."""

    def __init__(self, host: str, port: int) -> None:
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(address)  # vLLM's gRPC server has no TLS
        except RuntimeError as e:
            raise OSError(f"cannot bind {address}: {e}") from None
        if not self.port:
            raise OSError(f"cannot bind {address}")
        self.address = address

    def add(self, servicer: Any, engine: Any) -> None:
        from grpc_health.v1 import health_pb2_grpc

        from .health import EngineHealth

        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, self.server)
        self.health = EngineHealth(engine)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)

    async def start(self) -> None:
        await self.server.start()

    async def wait(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self, grace: float | None = 5.0) -> None:
        if getattr(self, "health", None) is not None:
            self.health.shutting_down = True
        await self.server.stop(grace)

