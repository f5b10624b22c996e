"""File descriptors for a server of many connections (serve).

vLLM's API server raises its soft RLIMIT_NOFILE to 65535 (or the hard limit, if lower) at
start-up, so that thousands of client connections do not fail with "Too many open files" on a
machine whose default soft limit is 1024; `serve` does the same.

The kernel grows a process's descriptor table by doubling it, and in a process with more than one
thread (serve's tokenizer threads) each growth waits for an RCU grace period: 8-16 ms measured
here, holding the event loop inside `accept()` just when a burst of new connections arrives (256
connections outgrow the first table once, 1000 twice). A table never shrinks, so serve grows it
once at start-up, before any thread exists: a descriptor duplicated to a high number, then closed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import resource

logger = logging.getLogger("vllm_vcr.serve")

TARGET_SOFT_LIMIT = 65535  # vLLM's set_ulimit target
FD_TABLE_SIZE = 16384  # slots made up front (128 KB of kernel pointers); beyond them it grows as usual


def prepare_for_many_connections() -> None:
    """Raise the soft open-file limit as vLLM does, and size the descriptor table up front."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = TARGET_SOFT_LIMIT if hard == resource.RLIM_INFINITY else min(hard, TARGET_SOFT_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            logger.warning("open-file limit %d could not be raised to %d (%s): many concurrent connections "
                           "may fail with 'Too many open files'; raise it with `ulimit -n`", soft, want, e)
    top = FD_TABLE_SIZE if soft == resource.RLIM_INFINITY else min(soft, FD_TABLE_SIZE)
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        # F_DUPFD takes the lowest free descriptor >= top - 1: it never replaces one in use
        high = fcntl.fcntl(fd, fcntl.F_DUPFD, top - 1)
        os.close(high)
    except OSError:  # a limit below what is open already: nothing to size
        pass
    finally:
        os.close(fd)
