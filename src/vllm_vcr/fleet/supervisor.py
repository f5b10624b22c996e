"""The fleet's parent process: one child per host process (fleet/host.py), signals forwarded.

Each child gets its workers pickled on stdin and reports `ready ...` on stdout once all of them
listen. The children run in their own process group, so a terminal's Ctrl-C reaches them once,
through the parent (a second one aborts what is in flight, as for serve); a child whose parent
dies gets SIGTERM (Linux). A child that fails makes the parent stop the others.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import pickle
import selectors
import signal
import subprocess
import sys
import time

from .plan import WorkerPlan, write_ports_file

logger = logging.getLogger("vllm_vcr.fleet")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def run_hosts(shards: list[list[WorkerPlan]], ports_file: str | None = None) -> int:
    t0 = time.perf_counter()
    children: list[subprocess.Popen] = []
    forwarded = []

    def forward(sig: int, _frame: object) -> None:
        forwarded.append(sig)
        for child in children:
            if child.poll() is None:
                child.send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for k, plans in enumerate(shards):
            child = subprocess.Popen([sys.executable, "-m", "vllm_vcr.fleet.host"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            children.append(child)
            try:
                child.stdin.write(pickle.dumps(plans))
                child.stdin.close()
            except BaseException:
                forward(signal.SIGTERM, None)
                for c in children:
                    _wait(c)
                raise
        workers = sum(len(s) for s in shards)
        ready = _wait_ready(children)
        failed = next((c for c in children if c.poll() is not None), None) \
            if ready is None and not forwarded else None
        if ready is not None:
            if ports_file:
                write_ports_file(ports_file, ready)
            logger.info("fleet: %d workers in %d processes ready in %.2f s", workers, len(children),
                        time.perf_counter() - t0)
        elif not forwarded:
            logger.error("fleet: a host process failed to start; stopping the others")
            forward(signal.SIGTERM, None)
        codes = [_wait(child) for child in children]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed is not None:  # the fleet's status is the failure's, not that of the hosts stopped for it
        return _status(failed.returncode)
    # a host the signal reached before it could handle it (still starting) ended by it, as asked
    return max((0 if -code in (signal.SIGTERM, signal.SIGINT) else _status(code) for code in codes), default=0)


def _status(code: int) -> int:
    return code if code >= 0 else 128 - code


def _wait_ready(children: list[subprocess.Popen]) -> list[dict] | None:
    """Until every child printed `ready` (their workers), or one ended first (None)."""
    sel = selectors.DefaultSelector()
    for child in children:
        sel.register(child.stdout, selectors.EVENT_READ, child)
    waiting = set(children)
    workers: list[dict] = []
    try:
        while waiting:
            for key, _ in sel.select(timeout=1.0):
                line = key.fileobj.readline()
                if not line:  # the child ended (or closed its stdout) before it was ready
                    return None
                if line.startswith(b"ready "):
                    workers += json.loads(line[6:])
                    waiting.discard(key.data)
                    sel.unregister(key.fileobj)
            if any(c.poll() is not None for c in waiting):
                return None
        return workers
    finally:
        sel.close()


def _wait(child: subprocess.Popen) -> int:
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
    if child.stdout is not None:
        child.stdout.close()
    return code
