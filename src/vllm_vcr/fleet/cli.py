"""`vllm-vcr fleet`: M independent mock workers (each a whole `serve`: its own port, /metrics,
engine, control API, KV-events and forward-pass-metrics endpoints), hosted by as many processes
as there are cores, each process one event loop serving many workers.

`vllm-vcr fleet --workers 100 --base-port 9000 [serve's flags, applied to all]`, or a YAML file of
workers (`--workers-config`) for a mixed fleet. The parent process starts the hosts, forwards
SIGTERM/SIGINT to them (every worker drains as serve does) and exits with the worst status.

This module is imported to build the `vllm-vcr` parser, so it imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..cli_types import port_number, positive_int

DEFAULT_BASE_PORT = 8000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fleet", help="run many mock workers (each a `serve`) in a few processes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Start M independent mock workers, each with its own port, /metrics, engine and "
                    "(optionally) control API, KV-events and forward-pass-metrics endpoints, hosted by one "
                    "process per core. serve's flags apply to every worker; --workers-config gives each "
                    "worker its own.")
    g = p.add_argument_group("fleet")
    g.add_argument("--workers", type=positive_int, default=None, metavar="M",
                   help="identical workers (default 1; not with --workers-config)")
    g.add_argument("--workers-config", default=None, metavar="FILE.yaml",
                   help="a YAML list of workers: serve flags per worker (`engine-type: sglang`), `model`, "
                        "`name`, `count`")
    g.add_argument("--base-port", type=port_number, default=DEFAULT_BASE_PORT,
                   help="worker i listens on BASE_PORT + i (0: any free port each)")
    g.add_argument("--processes", type=positive_int, default=None, metavar="N",
                   help="host processes (default: the cores this process may run on, at most M)")
    g.add_argument("--name-prefix", default="worker",
                   help="worker i is named PREFIX-i (x-inference-worker header) unless the YAML names it")
    g.add_argument("--control-base-port", type=port_number, default=None,
                   help="worker i's control API on CONTROL_HOST:CONTROL_BASE_PORT + i (default: none)")
    g.add_argument("--control-host", default="127.0.0.1", help="the control APIs' address")
    g.add_argument("--kv-events-base-port", type=port_number, default=None,
                   help="worker i publishes KV cache events (ZMQ PUB) on tcp://*:KV_EVENTS_BASE_PORT + its "
                        "offset (one port per engine)")
    g.add_argument("--fpm-base-port", type=port_number, default=None,
                   help="worker i publishes forward-pass metrics from FPM_BASE_PORT + its offset (one port per engine)")
    g.add_argument("--ports-file", default=None, metavar="FILE.json",
                   help="once every worker listens, write their names, ports and control ports here (JSON)")
    from ..serve.cli import add_arguments as add_serve_arguments

    add_serve_arguments(p)  # serve's flags, for every worker: one table, read by both commands
    p.set_defaults(_fleet_parser=p, port=None)
    return p


def run(args: argparse.Namespace) -> int:
    from .plan import PlanError, load_worker_groups, plan_workers, shard, write_ports_file

    prog = args._fleet_parser.prog
    try:
        _check_fleet_flags(args)
        groups = load_worker_groups(args.workers_config) if args.workers_config else None
        plans = plan_workers(args, groups)
    except PlanError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    processes = min(args.processes or _cores(), len(plans))
    shards = shard(plans, processes)
    if len(shards) == 1:
        from .host import run_host

        ports_file = args.ports_file
        return run_host(shards[0], on_ready=(lambda workers: write_ports_file(ports_file, workers)) if ports_file
                        else None)
    from .supervisor import run_hosts

    return run_hosts(shards, args.ports_file)


def _check_fleet_flags(args: argparse.Namespace) -> None:
    from .plan import PlanError

    if args.workers_config and args.workers is not None:
        raise PlanError("--workers and --workers-config: give one (the YAML file counts its workers)")
    if args.workers is None:
        args.workers = 1
    if args.port is not None:
        raise PlanError("--port: a fleet numbers its workers' ports from --base-port")
    if args.config is not None:
        raise PlanError("--config: a fleet reads its workers from --workers-config")
    from ..serve.settings import CLIError, check_ranges

    try:
        check_ranges(args)  # serve's own range checks, before any host process starts
    except CLIError as e:
        raise PlanError(str(e)) from None
    # serve's --control-address (or MOCK_CONTROL_ADDRESS) would be one address for all: a fleet
    # gives each worker its own with --control-base-port, or sets it per worker in the YAML file
    args.control_address_for_all = None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
