"""One ZMQ PUB socket per DP rank (port = base + rank, as KV events), Dynamo's FPM framing:
multipart `[topic, sequence number (8 bytes big-endian), msgpack(ForwardPassMetrics)]`."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq

from .record import ForwardPassMetrics, encode

logger = logging.getLogger("vllm_vcr.fpm")
DEFAULT_FPM_PORT = 20380  # Dynamo's default (DYN_VLLM_FORWARDPASS_METRIC_PORT)
HEARTBEAT_INTERVAL = 1.0  # s without a step before an idle record (Dynamo's publisher)


class FpmPublisher:
    """Publishes a rank's records; a full send queue drops the record (a slow subscriber never
    stalls the engine), as Dynamo's publisher does."""

    def __init__(self, endpoint: str, topic: bytes = b"", hwm: int = 100_000) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.seq = 0
        self.dropped = 0
        self.idle: ForwardPassMetrics | None = None  # the heartbeat record (attach_fpm sets it)
        self.last_publish = time.monotonic()

    def publish(self, metrics: ForwardPassMetrics) -> None:
        self.last_publish = time.monotonic()
        try:
            self._sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), encode(metrics)), flags=zmq.NOBLOCK)
            self.seq += 1
        except zmq.Again:
            self.dropped += 1
        except zmq.ZMQError:
            logger.warning("FPM publish on %s failed", self.endpoint, exc_info=True)

    async def heartbeat(self, idle: ForwardPassMetrics, interval: float = HEARTBEAT_INTERVAL) -> None:
        """While no step is published for `interval`, publish `idle` (all zeros, wall_time 0) every
        `interval`, so a planner can tell an idle rank from a dead one."""
        while True:
            await asyncio.sleep(max(self.last_publish + interval - time.monotonic(), 0.01))
            if time.monotonic() - self.last_publish >= interval:
                self.publish(idle)

    def close(self) -> None:
        self._sock.close(linger=0)


def rank_endpoint(host: str, base_port: int, dp_rank: int) -> str:
    return f"tcp://{host}:{base_port + dp_rank}"
