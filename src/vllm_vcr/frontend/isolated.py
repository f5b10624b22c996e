"""Expensive work on a client's input, in child processes with a hard deadline.

Compiling and sampling a client's grammar, regex or JSON schema, and rendering a chat template
the client sent, can take unbounded time and memory; some of it is C code that holds the GIL, so
a thread cannot be stopped and starves the event loop. `IsolatedPool.run` sends a call (a
module-level function and picklable arguments) to one of a few worker processes and waits for
the answer without blocking the event loop:

* time: after `timeout` seconds the worker is killed (SIGKILL) and `BudgetExceeded` is raised;
  the same when the awaiting task is cancelled (its client left). A fresh worker replaces it.
* memory: the worker's resident size is read every `POLL_S` while it works; past `memory_mb`
  it is killed and `BudgetExceeded` raised (an address-space limit does not work: allocators
  such as mimalloc reserve gigabytes they never touch); a worker whose RSS has grown by more than
  `recycle_mb` exits after its answer, so the server keeps none of a bomb's memory.
* concurrency: at most `workers` calls at once per event loop, each in its own process, so one
  request cannot hold the others for longer than its deadline.
* shutdown: workers are daemon processes of a forkserver; they are killed at exit (and exit on
  their own when the server's end of their pipe closes), so none keeps the process alive.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import multiprocessing
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE")
POLL_S = 0.05  # how often a working worker's memory is read
_PRELOAD: set[str] = set()  # every pool's modules: the pools share multiprocessing's one forkserver


class BudgetExceeded(Exception):
    """The call ran out of its time or memory budget (or its worker died)."""

    def __init__(self, reason: str, seconds: float = 0.0):
        super().__init__(reason)
        self.reason = reason  # "time" | "memory" | "died"
        self.seconds = seconds


def _statm(pid: int | str = "self") -> tuple[int, int]:
    """(virtual size, resident size) of a process, in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        size, rss = f.read().split()[:2]
    return int(size) * _PAGE, int(rss) * _PAGE


def _worker_main(conn: Any, recycle_mb: int) -> None:
    rss0 = _statm()[1]
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        try:
            kind, value = "ok", fn(*args)
        except MemoryError:
            kind, value = "memory", None
        except Exception as e:  # noqa: BLE001 - the caller's exception, raised again in the server
            kind, value = "error", e
        # grown: exit after this answer rather than keep the memory (the pool starts a fresh worker)
        retire = recycle_mb > 0 and _statm()[1] - rss0 > recycle_mb * 1024 * 1024
        try:
            conn.send((kind, value, retire))
        except Exception as e:  # noqa: BLE001 - an answer or exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}"), retire))
        kind = value = None  # type: ignore[assignment]
        if retire:
            return


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class _Worker:
    def __init__(self, ctx: Any, recycle_mb: int) -> None:
        parent, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, recycle_mb),
                                   name="vllm-vcr-isolated", daemon=True)
        self.process.start()
        child.close()
        self.conn = parent
        self.lock = threading.Lock()
        self.killed = False
        self.busy = False  # an exchange thread uses the pipe

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()

    def rss(self) -> int:
        try:
            return _statm(self.process.pid)[1]
        except (OSError, ValueError):
            return 0

    def exchange(self, loop: asyncio.AbstractEventLoop, answer: asyncio.Future, call: tuple) -> None:
        """Send the call and wait for its answer in a daemon thread (a pipe's blocking reads and
        writes of any size; the thread ends when the answer comes or the worker is killed)."""
        def run() -> None:
            result, error = None, None
            try:
                self.conn.send(call)
                result = self.conn.recv()
            except BaseException as e:  # noqa: BLE001 - EOF: the worker died or was killed
                error = e if isinstance(e, Exception) else EOFError()
            with self.lock:
                self.busy = False
                if self.killed:
                    self._close()
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
                loop.call_soon_threadsafe(_settle, answer, result, error)

        self.busy = True
        threading.Thread(target=run, name="vllm-vcr-isolated-io", daemon=True).start()

    def kill(self) -> None:
        """SIGKILL; the exchange thread sees EOF and closes the pipe (or it is closed here)."""
        with self.lock:
            self.killed = True
            if not self.busy:
                self._close()
        with contextlib.suppress(Exception):
            self.process.kill()
        # reap without blocking the loop: a killed process is gone within milliseconds
        threading.Thread(target=self.process.join, args=(5,), daemon=True).start()


class IsolatedPool:
    """A few worker processes for calls that need a hard time and memory bound."""

    def __init__(self, workers: int = 2, memory_mb: int = 1024, recycle_mb: int = 256,
                 preload: Sequence[str] = ()) -> None:
        self.workers = workers
        self.memory_mb = memory_mb
        self.recycle_mb = recycle_mb
        _PRELOAD.update(preload)
        self._ctx: Any = None
        self._idle: list[_Worker] = []
        self._all: weakref.WeakSet[_Worker] = weakref.WeakSet()
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> Semaphore
        self._lock = threading.Lock()
        atexit.register(self.close)

    def _spawn(self) -> _Worker:
        with self._lock:
            if self._ctx is None:
                self._ctx = multiprocessing.get_context("forkserver")
                self._ctx.set_forkserver_preload(sorted(_PRELOAD))  # no effect once the server runs
            worker = _Worker(self._ctx, self.recycle_mb)
            self._all.add(worker)
            return worker

    def warm(self) -> None:
        """Start one worker (and the forkserver, which imports the pools' modules) in a daemon
        thread, so that the first call does not wait for them."""
        def start() -> None:
            with contextlib.suppress(Exception):
                self._give_back(self._spawn())

        threading.Thread(target=start, name="vllm-vcr-isolated-warm", daemon=True).start()

    def _take(self) -> _Worker | None:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.process.is_alive():
                    return worker
                worker.kill()
            return None

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """`fn(*args)` in a worker; its exception is raised here; BudgetExceeded after `timeout`
        seconds, when the worker runs out of memory or dies."""
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots[loop] = asyncio.Semaphore(self.workers)
        async with slots:
            worker = self._take() or await loop.run_in_executor(None, self._spawn)
            ok = False
            answer: asyncio.Future = loop.create_future()
            worker.exchange(loop, answer, (fn, args))
            try:
                kind, value, retire = await self._watch(loop, worker, answer, timeout)
                ok = not retire
            except (EOFError, OSError):
                raise BudgetExceeded("died") from None
            finally:
                if ok:
                    self._give_back(worker)
                else:  # timed out, cancelled (the client left), broken or retiring: never reuse it
                    answer.cancel()
                    worker.kill()
        if kind == "ok":
            return value
        if kind == "memory":
            raise BudgetExceeded("memory")
        raise value

    async def _watch(self, loop: asyncio.AbstractEventLoop, worker: _Worker, answer: asyncio.Future,
                     timeout: float) -> tuple[str, Any, bool]:
        """The worker's answer (kind, value, whether it retires); BudgetExceeded at the deadline or past the memory bound."""
        deadline = loop.time() + timeout
        limit = self.memory_mb * 1024 * 1024
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise BudgetExceeded("time", timeout)
            done, _ = await asyncio.wait({answer}, timeout=min(POLL_S, left))
            if done:
                return answer.result()
            if limit > 0 and worker.rss() > limit:
                raise BudgetExceeded("memory")

    def close(self) -> None:
        """Kill every worker (at exit; the pool starts new ones if used again)."""
        with self._lock:
            self._idle.clear()
            workers = list(self._all)
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.process.kill()
            with contextlib.suppress(Exception):
                worker.conn.close()
