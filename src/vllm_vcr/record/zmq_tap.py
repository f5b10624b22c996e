"""`record` without `--http`: the engine-core tap between a vLLM frontend and its engine.

    frontend (vllm serve --data-parallel-size-local 0 ...)        real engine (vllm serve --headless)
        handshake ROUTER  <── tap DEALER (as engine 0)            tap ROUTER (as frontend) <── DEALER
        input ROUTER      <── tap DEALER ── forwards ──>  tap input ROUTER  ──> engine DEALER
        output PULL       <── tap PUSH  <── forwards ──   tap output PULL   <── engine PUSH

The tap says HELLO to the frontend first (to learn how many API servers it has), offers the
engine the same number of input/output pairs, and once the engine is READY finishes joining the
frontend with the engine's own ready payload. Then every frame is forwarded first and observed
after (undecodable frames are forwarded too); pair k of one side is pair k of the other.
Limitations: one engine (no DP coordinator), aborted requests are not recorded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..trace.io import TraceWriter
from ..trace.schema import SOURCE_TAP, TraceMeta
from .tap_recorder import TapRecorder

log = logging.getLogger(__name__)


_ENGINE0 = (0).to_bytes(2, "little")  # vLLM's engine identity: the DP rank, 2 bytes LE


class TapError(RuntimeError):
    pass


@dataclass
class ZmqTapConfig:
    frontend_handshake: str
    engine_handshake: str
    input_address: str
    output_address: str
    trace_out: str
    step_stats_out: str | None = None
    model: str = ""
    gpu: str | None = None
    tp: int | None = None
    max_num_seqs: int | None = None
    config_hash: str | None = None
    vllm_version: str | None = None  # expected major.minor of the engine, e.g. v0.33.0
    engine_config: str = ""
    block_size: int = 16
    record_tokens: bool = False
    handshake_timeout_s: float = 3600.0  # the engine loads its model in the middle
    extra_meta: dict[str, Any] = field(default_factory=dict)


def config_hash(gpu: str | None, vllm_tag: str | None, engine_config: str) -> str:
    """The capture fingerprint: hardware + vLLM version + behavioural engine flags."""
    text = f"config-fingerprint-v3\ngpu={gpu or ''}\nvllm_tag={vllm_tag or ''}\nengine_config={engine_config}\n"
    return hashlib.sha256(text.encode()).hexdigest()


def _major_minor(v: str | None) -> tuple[str, ...] | None:
    if not v:
        return None
    parts = v.lstrip("vV").split(".")
    return tuple(parts[:2]) if len(parts) >= 2 else None


async def _recv(sock: Any, what: str, timeout: float) -> list[bytes]:
    try:
        return await asyncio.wait_for(sock.recv_multipart(), timeout)
    except TimeoutError:
        raise TapError(f"timed out after {timeout:.0f} s waiting for {what}") from None


class ZmqTap:
    def __init__(self, cfg: ZmqTapConfig):
        import zmq.asyncio

        from ..wire.codec import Codec

        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.codec = Codec()  # the wire adapter's decoders for ADD / ABORT / UTILITY bodies
        self.rec = TapRecorder(cfg.block_size, cfg.record_tokens)
        self.writer: TraceWriter | None = None
        self.sidecar: TraceWriter | None = None
        self._sockets: list[Any] = []
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        self.engine_identity: bytes | None = None
        self.ready_payload: bytes = b""
        self.recorded = 0
        self.frames_in = 0
        self.frames_out = 0

    def _sock(self, kind: int, **opts: Any) -> Any:
        import zmq

        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        for k, v in opts.items():
            s.setsockopt(getattr(zmq, k), v)
        self._sockets.append(s)
        return s

    # -- handshakes -----------------------------------------------------------------------------

    async def hello_frontend(self) -> None:
        """Introduce ourselves to the frontend as engine 0 and learn its API-server sockets."""
        import zmq

        self.fe_hs = self._sock(zmq.DEALER, IDENTITY=_ENGINE0)
        self.fe_hs.setsockopt(zmq.LINGER, 2000)
        self.fe_hs.connect(self.cfg.frontend_handshake)
        await self.fe_hs.send(self._enc.encode({"status": "HELLO", "local": False, "headless": True}))
        log.info("HELLO sent to the frontend on %s", self.cfg.frontend_handshake)
        frames = await _recv(self.fe_hs, f"the frontend's init on {self.cfg.frontend_handshake}",
                             self.cfg.handshake_timeout_s)
        addresses = self._dec.decode(frames[-1])["addresses"]
        if addresses.get("coordinator_input"):
            raise TapError("the frontend runs a DP coordinator; the tap supports one engine only")
        self.fe_inputs, self.fe_outputs = list(addresses["inputs"]), list(addresses["outputs"])
        if not self.fe_inputs or len(self.fe_inputs) != len(self.fe_outputs):
            raise TapError("the frontend's init has no or unpaired input/output addresses")

    def _bind(self, sock: Any, address: str, k: int) -> str:
        """The k-th engine-side socket: the flag's address first, then any free port / path."""
        if k == 0:
            sock.bind(address)
            return address
        if address.startswith("ipc://"):
            sock.bind(f"{address}-{k}")
            return f"{address}-{k}"
        host = address[len("tcp://"):].rsplit(":", 1)[0]
        return f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"

    async def accept_engine(self) -> dict[str, Any]:
        """Be the frontend for the real engine, with as many input/output pairs as the real
        frontend has API servers: HELLO -> init -> ready payload on every input -> READY."""
        import zmq

        n = len(self.fe_inputs)
        hs = self._sock(zmq.ROUTER)
        hs.bind(self.cfg.engine_handshake)
        self.eng_in, self.eng_out, ins, outs = [], [], [], []
        for k in range(n):
            s = self._sock(zmq.ROUTER, RCVHWM=0, SNDHWM=0)
            ins.append(self._bind(s, self.cfg.input_address, k))
            self.eng_in.append(s)
            s = self._sock(zmq.PULL, RCVHWM=0)
            outs.append(self._bind(s, self.cfg.output_address, k))
            self.eng_out.append(s)
        log.info("waiting for the engine on %s", self.cfg.engine_handshake)
        t = self.cfg.handshake_timeout_s
        ident, hello = await _recv(hs, f"the engine's HELLO on {self.cfg.engine_handshake}", t)
        msg = self._dec.decode(hello)
        if not isinstance(msg, dict) or msg.get("status") != "HELLO":
            raise TapError(f"expected HELLO from the engine, got {msg!r}")
        init = {"addresses": {"inputs": ins, "outputs": outs, "coordinator_input": None,
                              "coordinator_output": None, "frontend_stats_publish_address": None},
                "parallel_config": {}}
        await hs.send_multipart([ident, self._enc.encode(init)])
        log.info("engine %r connected; waiting for it to load and report ready", ident)
        for k, sock in enumerate(self.eng_in):
            self.engine_identity, payload = await _recv(
                sock, f"the engine's ready payload on input {k}", t)
            if k == 0:
                self.ready_payload = payload
        _, ready = await _recv(hs, "the engine's READY", t)
        if self._dec.decode(ready).get("status") != "READY":
            raise TapError("expected READY from the engine")
        hs.close(linger=0)
        info = self._dec.decode(self.ready_payload) if self.ready_payload else {}
        return info if isinstance(info, dict) else {}

    async def join_frontend(self) -> None:
        """Finish joining the frontend, relaying the engine's ready payload verbatim."""
        import zmq

        self.fe_in = []
        for a in self.fe_inputs:
            s = self._sock(zmq.DEALER, IDENTITY=_ENGINE0, RCVHWM=0, SNDHWM=0)
            s.connect(a)
            await s.send(self.ready_payload)  # registers us; requests follow
            self.fe_in.append(s)
        self.fe_out = []
        for a in self.fe_outputs:
            s = self._sock(zmq.PUSH, SNDHWM=0)
            s.connect(a)
            self.fe_out.append(s)
        await self.fe_hs.send(self._enc.encode({"status": "READY", "local": False, "headless": True}))
        self.fe_hs.close(linger=2000)
        log.info("joined the frontend (%d API server(s))", len(self.fe_in))

    def _meta(self, info: dict[str, Any]) -> TraceMeta:
        cfg = self.cfg
        version = info.get("vllm_version") if isinstance(info.get("vllm_version"), str) else None
        return TraceMeta(
            model=cfg.model or None, gpu=cfg.gpu, tp=cfg.tp, max_num_seqs=cfg.max_num_seqs,
            source=SOURCE_TAP, block_size=cfg.block_size,
            config_hash=cfg.config_hash or config_hash(cfg.gpu, cfg.vllm_version or version,
                                                       cfg.engine_config),
            vllm_version=version, ready_response_hex=self.ready_payload.hex(),
            extra=dict(cfg.extra_meta) or None,
        )

    # -- relaying -------------------------------------------------------------------------------

    async def _frontend_to_engine(self, k: int) -> None:
        from ..wire.codec import ABORT, ADD, FrameError

        src, dst = self.fe_in[k], self.eng_in[k]
        while True:
            frames = await src.recv_multipart()
            t = time.perf_counter()
            await dst.send_multipart([self.engine_identity, *frames])  # forward first
            self.frames_in += 1
            if len(frames) < 2:
                continue
            try:
                if frames[0] == ADD:
                    self.rec.on_add(self.codec.decode_add(frames[1:]), t)
                elif frames[0] == ABORT:
                    self.rec.on_abort(self.codec.decode_abort(frames[1:]))
            except FrameError as e:
                log.warning("relayed an input frame the tap cannot read: %s", e)

    async def _engine_to_frontend(self, k: int) -> None:
        src, dst = self.eng_out[k], self.fe_out[k]
        while True:
            frames = await src.recv_multipart()
            t = time.perf_counter()
            await dst.send_multipart(frames)  # forward first
            self.frames_out += 1
            try:
                envelope = self.codec.decode_any(frames[0])
            except Exception as e:  # noqa: BLE001 - forwarded anyway, just not observed
                if frames[0] != b"ENGINE_CORE_DEAD":
                    log.warning("relayed an output frame the tap cannot read: %s", e)
                continue
            for record in self.rec.on_outputs(envelope, t):
                self.writer.write(record)
                self.recorded += 1
            if self.sidecar is not None:
                line = self.rec.step_stats_line(envelope, t)
                if line is not None:
                    self.sidecar.write_json(line)

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop` is set (also during the handshakes) or a relay fails."""
        main = asyncio.create_task(self._run())
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([main, stopper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (main, stopper):
                task.cancel()
            try:
                await main
            except asyncio.CancelledError:
                pass
            finally:
                self.close()

    async def _run(self) -> None:
        await self.hello_frontend()
        info = await self.accept_engine()
        want, got = _major_minor(self.cfg.vllm_version), _major_minor(info.get("vllm_version"))
        if want and got and want != got:
            raise TapError(f"engine reports vLLM {info.get('vllm_version')}, "
                           f"--vllm-version says {self.cfg.vllm_version}")
        await self.join_frontend()
        self.writer = TraceWriter(self.cfg.trace_out, self._meta(info))
        if self.cfg.step_stats_out:
            self.sidecar = TraceWriter(self.cfg.step_stats_out)
        relays = [self._frontend_to_engine(k) for k in range(len(self.fe_in))]
        relays += [self._engine_to_frontend(k) for k in range(len(self.fe_out))]
        await asyncio.gather(*relays)

    def close(self) -> None:
        for w in (self.writer, self.sidecar):
            if w is not None:
                w.close()  # gzip trailer, even on errors
        self.writer = self.sidecar = None
        for s in self._sockets:
            if not s.closed:
                s.close(linger=0)
        self.ctx.term()
