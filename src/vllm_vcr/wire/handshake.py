"""The engine side of vLLM's startup handshake (vllm-protocol.md §2, §6).

HELLO -> init (addresses) -> ready payload on every input socket -> (DP coordinator subscription,
wait for its READY) -> READY. One call per engine rank; ranks of one process run concurrently
because the coordinator answers READY only once every engine has subscribed.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from .codec import COORDINATOR_READY

log = logging.getLogger("vllm_vcr.wire.handshake")

# What a max_model_len of 0 (no arrival check) advertises: the frontend keeps min(own, ours).
UNLIMITED_MODEL_LEN = 1_048_576


class HandshakeError(RuntimeError):
    pass


@dataclass
class ReadyInfo:
    """The engine facts the ready payload reports (the real engine's EngineCoreReadyResponse)."""

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    data_parallel_size: int = 1
    dtype: str = "bfloat16"
    vllm_version: str = "0.33.0"
    instance_id: str = ""
    max_loras: int = 0  # a real engine reports LoRA support exactly when it has LoRA slots
    enable_sleep_mode: bool = True
    kv_events_config: dict[str, Any] | None = None  # this rank's publisher config (GET /kv_event_sources)


@dataclass
class EngineSockets:
    rank: int
    identity: bytes
    inputs: list[zmq.asyncio.Socket]
    outputs: list[zmq.Socket]  # plain sockets: sends happen synchronously from the engine loop
    coordinator_in: zmq.asyncio.Socket | None = None
    coordinator_out: zmq.Socket | None = None
    addresses: dict[str, Any] = field(default_factory=dict)

    def close(self, linger_ms: int = 4000) -> None:
        for s in [*self.inputs, *self.outputs, self.coordinator_in, self.coordinator_out]:
            if s is not None and not s.closed:
                s.close(linger=linger_ms)


def identity_for(rank: int) -> bytes:
    if not 0 <= rank < 1 << 16:
        raise HandshakeError(f"DP rank {rank} does not fit vLLM's 2-byte engine identity")
    return rank.to_bytes(2, "little")


def ready_payload(info: ReadyInfo, rank: int, addresses: dict[str, Any]) -> dict[str, Any]:
    tokens = info.num_gpu_blocks * info.block_size
    return {
        # the 17 keys every frontend requires, in definition order
        "max_model_len": info.max_model_len,
        "num_gpu_blocks": info.num_gpu_blocks,
        "block_size": info.block_size,
        "dp_stats_address": addresses.get("frontend_stats_publish_address"),  # asserted equal
        "dtype": info.dtype,
        "vllm_version": info.vllm_version,
        "world_size": 1,
        "data_parallel_size": info.data_parallel_size,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "data_parallel_rank": rank,
        "max_num_seqs": info.max_num_seqs,
        "max_num_batched_tokens": info.max_num_batched_tokens,
        "instance_id": info.instance_id or f"vllm-vcr-{uuid.uuid4().hex[:8]}",
        "supports_lora": info.max_loras > 0,  # vLLM's Rust frontend refuses any other pairing
        "max_loras": info.max_loras,
        # optional ones a real engine sends (they feed vllm:cache_config_info)
        "mamba_block_size": None,
        "kv_cache_size_tokens": tokens,
        "kv_cache_max_concurrency": float(tokens) / max(info.max_model_len, 1),
        "kv_events_config": info.kv_events_config,
        "enable_sleep_mode": info.enable_sleep_mode,
        # 0.33 asserts these equal across engines; 0.32 ignores them
        "coord_store_port": 0,
        "coordinator_input_address": addresses.get("coordinator_input"),
        "coordinator_output_address": addresses.get("coordinator_output"),
    }


async def _recv_logging(sock: zmq.asyncio.Socket, what: str, timeout: float) -> list[bytes]:
    """recv_multipart with a deadline, saying every 10 s what we are waiting for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise HandshakeError(f"timed out after {timeout:.0f} s waiting for {what}")
        try:
            return await asyncio.wait_for(sock.recv_multipart(), min(10.0, left))
        except TimeoutError:
            log.info("still waiting for %s", what)


async def handshake(
    ctx: zmq.asyncio.Context,
    address: str,
    rank: int,
    info: ReadyInfo,
    *,
    timeout: float = 300.0,
    load_time: float = 0.0,
    load_failure: str | None = None,
) -> EngineSockets:
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder()
    sync_ctx = zmq.Context.shadow(ctx.underlying)
    ident = identity_for(rank)

    hs = ctx.socket(zmq.DEALER)
    hs.setsockopt(zmq.IDENTITY, ident)
    hs.setsockopt(zmq.LINGER, 5000)
    hs.connect(address)
    sockets: EngineSockets | None = None
    try:
        await hs.send(enc.encode({"status": "HELLO", "local": False, "headless": True}))
        log.info("engine %d: HELLO sent to %s", rank, address)
        frames = await _recv_logging(hs, f"the frontend's init message on {address} (engine {rank})", timeout)
        try:
            init = dec.decode(frames[-1])
            addresses = init["addresses"]
            inputs_addr = list(addresses["inputs"])
            outputs_addr = list(addresses["outputs"])
        except Exception as e:  # noqa: BLE001
            raise HandshakeError(f"malformed init message from the frontend: {e}") from None
        if not inputs_addr or len(inputs_addr) != len(outputs_addr):
            raise HandshakeError(f"init has {len(inputs_addr)} inputs and {len(outputs_addr)} outputs")
        if init.get("parallel_config"):
            # Only MoE data parallelism fills it: its READY needs vLLM's config hash, which we
            # cannot compute.
            log.warning("engine %d: frontend sent a parallel_config (MoE data parallel?); "
                        "vllm-vcr supports non-MoE model configs only with DP>1", rank)

        # A real engine loads its model here, between the init message and its ready payload
        # (--startup-time); a failed load never answers, and the process exits.
        if load_time > 0:
            log.info("engine %d: simulating model loading for %.1fs", rank, load_time)
            await asyncio.sleep(load_time)
        if load_failure:
            raise HandshakeError(f"engine start-up failed: {load_failure}")
        sockets = EngineSockets(rank=rank, identity=ident, inputs=[], outputs=[], addresses=addresses)
        payload = enc.encode(ready_payload(info, rank, addresses))
        for a in inputs_addr:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, ident)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
            sockets.inputs.append(s)
            # The frontend learns our identity from this first message; requests come after it.
            await s.send(payload)
        for a in outputs_addr:
            s = sync_ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)  # never block the engine loop on a slow frontend
            s.setsockopt(zmq.LINGER, 4000)
            s.connect(a)
            sockets.outputs.append(s)

        if addresses.get("coordinator_input"):
            cin = ctx.socket(zmq.XSUB)
            cin.setsockopt(zmq.IDENTITY, ident)
            cin.connect(addresses["coordinator_input"])
            await cin.send(b"\x01")  # subscribe to everything
            cout = sync_ctx.socket(zmq.PUSH)
            cout.setsockopt(zmq.SNDHWM, 0)
            cout.setsockopt(zmq.LINGER, 4000)
            cout.connect(addresses["coordinator_output"])
            sockets.coordinator_in, sockets.coordinator_out = cin, cout
            while True:
                msg = await _recv_logging(cin, f"the DP coordinator's READY (engine {rank})", timeout)
                if msg and msg[-1] == COORDINATOR_READY:
                    break
                log.debug("engine %d: ignoring %d-frame coordinator message before READY", rank, len(msg))

        await hs.send(enc.encode({"status": "READY", "local": False, "headless": True}))
        log.info("engine %d: READY (%d input/output socket pair(s)%s)", rank, len(inputs_addr),
                 ", DP coordinator" if sockets.coordinator_in is not None else "")
        return sockets
    except BaseException:
        if sockets is not None:
            sockets.close(linger_ms=0)
        raise
    finally:
        hs.close(linger=5000)
