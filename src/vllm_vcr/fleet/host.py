"""One process of a fleet: many workers (each a whole `serve`: port, engine, /metrics, control API,
KV events) in one event loop.

A worker is serve's own command (serve/server.py), hosted: it shares the process's tokenizers
(one per model, template and renderer setting) and the process's one Date-header tick and heap
trimmer, and leaves signals to the host. An idle worker has no timer of its own: its engines
sleep until a request arrives. SIGTERM/SIGINT: every worker drains as serve does (a second
signal aborts what is left); a worker still starting is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import pickle
import signal
import sys
import time
from typing import Any, BinaryIO

from ..serve.server import Hosting, ServeCommand, identity_headers, prepare_process
from ..serve.settings import CLIError
from .plan import WorkerPlan

logger = logging.getLogger("vllm_vcr.fleet")


class FleetHost:
    def __init__(self, plans: list[WorkerPlan], env: Any = None, on_ready: Any = None) -> None:
        env = os.environ if env is None else env
        tokenizers: dict = {}
        warmed: set = set()
        self.plans = plans
        self.on_ready = on_ready
        self.commands = [
            ServeCommand(p.args, None, Hosting(
                own_signals=False, tokenizers=tokenizers, warmed=warmed, log_ready=False,
                headers=identity_headers(env, p.name) + [("x-inference-worker-index", str(p.index))]))
            for p in plans]
        self.tasks: list[asyncio.Task] = []
        self.signals = 0

    @staticmethod
    def describe(plan: WorkerPlan, cmd: ServeCommand) -> dict[str, Any]:
        """Where a ready worker answers (the fleet's ports file)."""
        out = {"name": plan.name, "index": plan.index, "port": cmd.sock.getsockname()[1], "pid": os.getpid()}
        if cmd.control is not None:
            out["control_port"] = cmd.control.port
        return out

    def handle_signal(self, sig: int) -> None:
        self.signals += 1
        if self.signals == 1:
            logger.info("received %s: draining %d workers", signal.Signals(sig).name, len(self.commands))
        for cmd, task in zip(self.commands, self.tasks):
            if cmd.server is not None:
                cmd.server.handle_exit(sig, None)
            elif not task.done():
                task.cancel()  # still starting: nothing to drain

    async def run(self) -> int:
        t0 = time.perf_counter()
        levels = {p.args.uvicorn_log_level for p in self.plans} - {None}
        if len(levels) == 1:  # before any server starts (the control APIs start before the workers' own)
            from uvicorn.config import LOG_LEVELS

            logging.getLogger("uvicorn.error").setLevel(LOG_LEVELS[levels.pop()])
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self.handle_signal, sig)
                installed.append(sig)
        try:
            self.tasks = [loop.create_task(cmd.run(), name=f"worker-{p.name}")
                          for cmd, p in zip(self.commands, self.plans)]
            failed = await self._wait_ready()
            if failed is not None:
                if not self.signals:  # (a signal has stopped them already)
                    self.handle_signal(signal.SIGTERM)
            else:
                gc.freeze()  # the workers' start-up heap stays out of every later collection
                logger.info("%d workers ready in %.2f s (ports %s)", len(self.commands), time.perf_counter() - t0,
                            _port_ranges([c.sock.getsockname()[1] for c in self.commands]))
                if self.on_ready is not None:
                    self.on_ready([self.describe(p, c) for p, c in zip(self.plans, self.commands)])
            codes = await asyncio.gather(*self.tasks, return_exceptions=True)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
        return _exit_code(failed, codes)

    async def _wait_ready(self) -> BaseException | None:
        """Until every worker listens; the first failure (a worker that ended first) otherwise."""
        pending = {asyncio.ensure_future(c.ready.wait()): c for c in self.commands}
        by_task = set(self.tasks)
        try:
            while pending:
                done, _ = await asyncio.wait(set(pending) | by_task, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    if fut in by_task:  # a worker ended before the others were ready
                        plan = self.plans[self.tasks.index(fut)]
                        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
                        if exc is None:
                            exc = RuntimeError(f"worker {plan.name} stopped during start-up")
                        if isinstance(exc, CLIError):
                            logger.error("worker %s: %s", plan.name, exc)
                        elif not isinstance(exc, asyncio.CancelledError):
                            logger.error("worker %s failed to start: %r", plan.name, exc)
                        return exc
                    pending.pop(fut)
            return None
        finally:
            for fut in pending:
                fut.cancel()


def _exit_code(failed: BaseException | None, codes: list[Any]) -> int:
    if isinstance(failed, CLIError):
        return 2
    if failed is not None and not isinstance(failed, asyncio.CancelledError):
        return 1
    worst = 0
    for code in codes:
        if isinstance(code, asyncio.CancelledError):
            continue
        if isinstance(code, BaseException):
            worst = max(worst, 1)
        else:
            worst = max(worst, int(code or 0))
    return worst


def _port_ranges(ports: list[int]) -> str:
    ports = sorted(ports)
    out: list[str] = []
    start = prev = ports[0]
    for p in ports[1:] + [None]:  # type: ignore[list-item]
        if p is not None and p == prev + 1:
            prev = p
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if p is not None:
            start = prev = p
    return ",".join(out)


# descriptors a worker holds while idle besides its listening sockets (the engine's wake-up pipe,
# a control server's, spare for a few client connections)
FDS_PER_WORKER = 4
FDS_FOR_THE_PROCESS = 64  # interpreter, tokenizer files, ZMQ context, the parent's pipes


def descriptors_needed(plans: list[WorkerPlan]) -> int:
    """Open files M idle workers need: API and control sockets, one per engine for KV events and for
    forward-pass metrics, and a margin; client connections come on top."""
    total = FDS_FOR_THE_PROCESS
    for p in plans:
        ns = p.args
        engines = max(int(getattr(ns, "engine_count", 1) or 1), int(getattr(ns, "data_parallel_size", None) or 1))
        total += FDS_PER_WORKER + (1 if ns.control_address else 0)
        total += engines * ((2 if ns.kv_events_config or ns.enable_kv_cache_events else 0)
                            + (1 if ns.forward_pass_metrics_port is not None else 0))
    return total


def run_host(plans: list[WorkerPlan], on_ready: Any = None) -> int:
    """Host `plans` in this process until a signal (the CLI's fleet with one process, or a child)."""
    import resource

    from .. import event_loop

    prepare_process()  # raises the soft open-file limit as far as the hard one allows
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = descriptors_needed(plans)
    if soft != resource.RLIM_INFINITY and soft < need:
        logger.error("open-file limit %d is below the ~%d that %d workers need in one process: raise it "
                     "(`ulimit -n`, the hard limit too) or use more --processes", soft, need, len(plans))
        return 2
    return event_loop.run(FleetHost(plans, on_ready=on_ready).run())


def main(stdin: BinaryIO | None = None, ready_out: Any = None) -> int:
    """A child process of the fleet: its workers arrive pickled on stdin (from the fleet command,
    in the same installation); a line `ready [{worker}, ...]` (JSON) goes to stdout once all listen."""
    stdin = stdin or sys.stdin.buffer
    ready_out = ready_out or sys.stdout
    plans = pickle.load(stdin)  # noqa: S301 - written by our own parent process

    def ready(workers: list[dict[str, Any]]) -> None:
        ready_out.write("ready " + json.dumps(workers) + "\n")
        ready_out.flush()

    from ..logging_setup import install_reloadable_logging

    install_reloadable_logging()
    return run_host(plans, on_ready=ready)


if __name__ == "__main__":
    sys.exit(main())
