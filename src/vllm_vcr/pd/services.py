"""Start-up wiring of the P/D network services, shared by `serve` and `play`.

    pd = await start_pd_services(cores, args)   # after the EngineCores exist, before traffic
    ...
    await pd.stop()

* release listener (vLLM NixlConnector flow): on prefill workers, and on aggregated workers
  only when `--side-channel-port` is given (so two default instances on one host do not fight
  over port 5600);
* every core's pulled listener (`core.kv_transfer`) tells the prefill side to release (side channel, or the bootstrap
  connection for a handoff session);
* bootstrap server (Dynamo flow): on prefill workers started with `--bootstrap-port`;
* every core's handoff observer, so requests carrying handoff metadata are served.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..engine.core import EngineCore
from .bootstrap import BootstrapServer
from .handoff import HandoffManager
from .side_channel import ReleaseListener, ReleaseNotifier

logger = logging.getLogger("vllm_vcr.pd")

DEFAULT_SESSION_TIMEOUT_MS = 300_000.0


class PDServices:
    def __init__(self, cores: list[EngineCore], listener: ReleaseListener | None, server: BootstrapServer | None,
                 handoffs: HandoffManager, notifier: ReleaseNotifier, listeners: list[Any]) -> None:
        self.cores = cores
        self.listener = listener
        self.server = server
        self.handoffs = handoffs
        self.notifier = notifier
        self._listeners = listeners

    @property
    def side_channel_ports(self) -> list[int]:
        return list(self.listener.ports) if self.listener else []

    @property
    def bootstrap_port(self) -> int | None:
        return self.server.port if self.server else None

    async def stop(self) -> None:
        for core, listener in zip(self.cores, self._listeners):
            core.kv_transfer.remove_pulled_listener(listener)
            core.kv_transfer.set_handoff_observer(None)
        if self.listener is not None:
            await self.listener.close()
        if self.server is not None:
            await self.server.close()
        await self.handoffs.close()
        await self.notifier.close()


def _pulled_listener(core: EngineCore, handoffs: HandoffManager,
                     notifier: ReleaseNotifier) -> Callable[[dict[str, Any]], None]:
    def on_kv_pulled(params: dict[str, Any]) -> None:
        # runs inside the engine step: must not raise or block
        try:
            if not handoffs.kv_pulled(core, params):
                notifier.notify(params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id"))
        except Exception:
            logger.exception("engine %d: telling the prefill side to release failed", core.engine_index)
    return on_kv_pulled


async def start_pd_services(cores: list[EngineCore], args: Any = None) -> PDServices:
    """Start what this worker needs for P/D; `args` is the CLI namespace (missing flags default).

    Raises OSError when a prefill worker cannot bind its release listener or bootstrap port."""
    if not cores:
        raise ValueError("start_pd_services needs at least one engine")
    eargs = cores[0].args
    worker = eargs.worker_type
    host = eargs.side_channel_host
    explicit_port = getattr(args, "side_channel_port", None)
    bootstrap_port = getattr(args, "bootstrap_port", None)
    timeout_ms = getattr(args, "handoff_session_timeout_ms", None) or DEFAULT_SESSION_TIMEOUT_MS
    session_timeout = float(timeout_ms) / 1000.0 / eargs.time_scale

    listener = None
    if worker == "prefill" or (worker == "aggregated" and explicit_port is not None):
        listener = ReleaseListener()
        try:
            await listener.start(cores, host, eargs.side_channel_port)
        except OSError as e:
            msg = f"--side-channel-port: KV release listener: {e.strerror or e}"
            if worker == "prefill":
                raise OSError(msg) from None
            logger.warning("%s; decode instances cannot release this one's KV early "
                           "(--kv-hold-timeout still frees it)", msg)
            listener = None

    server = None
    if bootstrap_port is not None:
        if worker != "prefill":
            logger.warning("--bootstrap-port ignored: only a prefill worker serves bootstrap handoffs")
        else:
            capacity = sum(c.config.max_num_seqs for c in cores)
            server = BootstrapServer(session_timeout, max_pending_connections=capacity)
            try:
                await server.start(host, int(bootstrap_port))
            except OSError as e:
                if listener is not None:
                    await listener.close()
                raise OSError(f"--bootstrap-port: bootstrap server: {e.strerror or e}") from None

    handoffs = HandoffManager(server, session_timeout)
    notifier = ReleaseNotifier()
    listeners = []
    for core in cores:
        listeners.append(_pulled_listener(core, handoffs, notifier))
        core.kv_transfer.add_pulled_listener(listeners[-1])
        core.kv_transfer.set_handoff_observer(handoffs.for_engine(core))
    pd = PDServices(cores, listener, server, handoffs, notifier, listeners)
    if listener is not None or server is not None:
        logger.info("P/D %s worker: KV release listener on %s, bootstrap server on %s", worker,
                    ", ".join(f"{host}:{p}" for p in pd.side_channel_ports) or "-",
                    f"{host}:{server.port}" if server else "-")
    return pd
