"""vLLM's ZMQ KV-event publisher (ZmqEventPublisher, 0.32/0.33), safe to call from the engine loop.

Wire behaviour follows vLLM:
  * PUB socket, one 3-frame message per batch: [topic, seq (8-byte big-endian, from 0), payload]
  * endpoint bound if it has "*" or "::" or is ipc/inproc, else connected; the port is offset
    by the DP rank (inproc gets "_dp<rank>"; port 0 is left alone)
  * optional ROUTER replay socket (always bound): a request [id, b"", start_seq8] is answered
    with [id, b"", topic, seq8, payload] for every buffered batch with seq >= start_seq, then
    [id, b"", b"", (-1 as 8 signed big-endian bytes), b""]; `buffer_steps` batches are kept and
    the replay SNDHWM is 2 * (buffer_steps + 1) (0.33's value, so a full replay fits)

Where it differs on purpose: vLLM's `publish` blocks when its queue is full; here `publish`
never blocks. It drops the batch (counted in `stats["dropped"]`, logged at most every 10 s)
and the sequence numbers stay gap-free, since they are assigned when a batch is sent.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Iterable

import zmq

from .config import KVEventsConfig
from .events import KVEventBatch, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-DP-rank endpoint: tcp port + rank, inproc name + "_dp<rank>"."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        head, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            return endpoint
        if int(port) == 0:  # an OS-chosen port needs no offset
            return endpoint
        return f"{head}:{int(port) + data_parallel_rank}"
    raise ValueError(f"invalid KV events endpoint {endpoint!r}: must be tcp:// or inproc://")


def is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _node_ip() -> str:
    # vLLM binds tcp://*:0 on the node IP so the reported endpoint is dialable
    ip = os.environ.get("VLLM_HOST_IP")
    if ip:
        return ip
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the endpoint to advertise (the real port when 0 was asked for)."""
    if endpoint == "tcp://*:0":
        ip = _node_ip()
        if ":" in ip:
            sock.setsockopt(zmq.IPV6, 1)
            ip = f"[{ip}]"
        sock.bind(f"tcp://{ip}:0")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.bind(endpoint)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint


class NullEventPublisher:
    """Events off: `publish` is a no-op."""

    data_parallel_rank = 0
    publisher_config: KVEventsConfig | None = None

    def publish(self, events: Iterable[Any], ts: float | None = None) -> bool:
        return False

    @property
    def stats(self) -> dict[str, int]:
        return {"published": 0, "dropped": 0, "queued": 0, "replay_requests": 0}

    def close(self, timeout: float = 1.0) -> None:
        return None


class KVEventPublisher:
    """PUB (+ replay ROUTER) publisher fed by a bounded queue and one daemon thread.

    `publish(events)` is what the engine calls once per step; it only wraps the list in a
    KVEventBatch and hands it to the thread (put_nowait), so a slow or absent subscriber
    never stalls the engine. Sockets are created and bound here, so a bad or busy address
    fails at startup; after that only the thread touches them.
    """

    POLL_INTERVAL = 0.05  # how long the idle thread waits before checking for replay requests

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 context: zmq.Context | None = None) -> None:
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._published = 0
        self._dropped = 0  # queue full; written by the engine thread only
        self._failed = 0  # encode/send errors; written by the publisher thread only
        self._replay_requests = 0
        self._stop_now = False
        self._last_drop_log = 0.0
        self._closed = False

        self._ctx = context or zmq.Context.instance()
        endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        assert endpoint is not None
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if is_bind_endpoint(endpoint):
                endpoint = _bind(self._pub, endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                replay_endpoint = _bind(self._replay, replay_endpoint)
        except Exception:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise

        # what the engine reports (READY response / GET /kv_event_sources): resolved addresses
        self.publisher_config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
            replay_endpoint=replay_endpoint, buffer_steps=config.buffer_steps, hwm=config.hwm,
            max_queue_size=config.max_queue_size, topic=config.topic)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint

        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{data_parallel_rank}",
                                        daemon=True)
        self._thread.start()

    # --- engine side ---------------------------------------------------------------------

    def publish(self, events: Iterable[Any], ts: float | None = None) -> bool:
        """Queue one step's events as a batch; never blocks. False if dropped or empty."""
        if self._closed:
            return False
        events = list(events)
        if not events:  # vLLM publishes nothing for a step without events
            return False
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                             data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
            return True
        except queue.Full:
            self._dropped += 1
            now = time.monotonic()
            if now - self._last_drop_log >= 10.0:
                self._last_drop_log = now
                log.warning("KV events: publisher queue full (%d batches); %d batches dropped so far",
                            self._queue.maxsize, self._dropped)
            return False

    @property
    def stats(self) -> dict[str, int]:
        return {"published": self._published, "dropped": self._dropped + self._failed,
                "queued": self._queue.qsize(), "replay_requests": self._replay_requests}

    def close(self, timeout: float = 1.0) -> None:
        """Flush what is queued (up to `timeout` seconds), then stop and close the sockets."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        try:  # behind everything already queued, so those batches go out first
            self._queue.put(_STOP, timeout=max(timeout, 0.001))
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._stop_now = True  # out of time: stop after the current batch
        self._thread.join(1.0)
        if self._thread.is_alive():  # never close sockets under a running thread
            log.warning("KV events: publisher thread did not stop; sockets left open")
            return
        # a moment for the last batches to leave the socket; never more than the caller allowed
        linger_ms = int(max(0.0, min(0.5, deadline - time.monotonic())) * 1000)
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)

    # --- publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        q = self._queue
        while not self._stop_now:
            if self._replay is not None:
                self._serve_replays()
            try:
                item = q.get(timeout=self.POLL_INTERVAL)
            except queue.Empty:
                continue
            # send it and up to 255 more that queued up meanwhile, then serve replays again
            sent = 0
            while True:
                if item is _STOP or not self._send_safe(item) or self._stop_now:
                    return
                sent += 1
                if sent == 256:
                    break
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break

    def _send_safe(self, batch: KVEventBatch) -> bool:
        """Send one batch; False when the thread must stop (context terminated)."""
        try:
            self._send(batch)
        except zmq.ZMQError as e:
            if e.errno == zmq.ETERM:
                return False
            log.warning("KV events: send failed: %s", e)
        except Exception:  # one bad batch must not kill the thread
            log.exception("KV events: could not encode a batch; dropped")
            self._failed += 1
        return True

    def _send(self, batch: KVEventBatch) -> None:
        payload = encode_batch(batch)
        seq = self._seq
        self._seq = seq + 1
        # buffered before it goes out, so a subscriber that sees seq N can replay it at once
        self._buffer.append((seq, payload))
        self._published += 1
        try:
            # PUB drops at HWM rather than block; NOBLOCK makes sure of it
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # nobody could take it now; it is still in the replay buffer

    def _serve_replays(self) -> None:
        rep = self._replay
        assert rep is not None
        while rep.poll(0):
            frames = rep.recv_multipart()
            self._replay_requests += 1
            if len(frames) != 3:  # vLLM ignores anything but [id, b"", start_seq]
                log.warning("KV events: bad replay request (%d frames); ignored", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        rep.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                                           flags=zmq.NOBLOCK)
                rep.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("KV events: replay client too slow; reply truncated")


def create_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0,
                     context: zmq.Context | None = None) -> KVEventPublisher | NullEventPublisher:
    """vLLM's EventPublisherFactory: a null publisher unless events are enabled with "zmq"."""
    if config is None or not config.active:
        return NullEventPublisher()
    return KVEventPublisher(config, data_parallel_rank, context)


__all__ = ["END_SEQ", "KVEventPublisher", "NullEventPublisher", "create_publisher",
           "is_bind_endpoint", "offset_endpoint_port"]
