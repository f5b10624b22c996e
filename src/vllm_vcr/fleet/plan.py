"""What a fleet is made of: one `serve` command line per worker, from the fleet's own command line
(`--workers M --base-port P` and serve's flags for all) or a YAML file of workers.

Every worker is parsed by serve's own parser: a worker's keys in the YAML file are serve's flags
(`key: value` -> `--key value`, as in vLLM's --config file), applied over the flags given on the
command line. The fleet assigns each worker its port (and, when asked, its control address,
KV-events endpoint and forward-pass-metrics port) from a base plus the worker's index, unless the
worker sets one itself.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from dataclasses import dataclass
from typing import Any

# serve's flags a fleet assigns per worker (the fleet's flag that replaces each)
PER_WORKER_FLAGS = {"--port": "--base-port"}
NAME_KEYS = ("name", "count", "model")
MAX_PORT = 65535


class PlanError(ValueError):
    """A fleet that cannot be built; the message names the flag or the YAML entry."""


@dataclass
class WorkerPlan:
    index: int
    name: str
    args: argparse.Namespace  # serve's parsed command line for this worker


def serve_parser() -> argparse.ArgumentParser:
    """A parser of serve's command line (serve/cli.py builds it; the fleet adds nothing to it)."""
    from ..serve.cli import add_parser

    holder = argparse.ArgumentParser(prog="vllm-vcr", add_help=False)
    parser = add_parser(holder.add_subparsers())

    def error(message: str) -> None:  # a bad worker flag is the fleet's one-line error, not an exit
        raise PlanError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def load_worker_groups(path: str) -> list[dict[str, Any]]:
    """The YAML file: a list of workers (or `workers:` holding one); each a mapping of serve flags
    plus `name`, `count` (copies of it) and `model` (serve's MODEL)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise PlanError(f"--workers-config: cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise PlanError(f"--workers-config: {path} is not YAML: {e}") from None
    if isinstance(doc, dict) and "workers" in doc:
        doc = doc["workers"]
    if not isinstance(doc, list) or not doc:
        raise PlanError(f"--workers-config: {path} must hold a non-empty list of workers (or `workers:` with one)")
    for i, group in enumerate(doc):
        if not isinstance(group, dict):
            raise PlanError(f"--workers-config: entry {i} must be a mapping of serve flags, got {group!r}")
        count = group.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise PlanError(f"--workers-config: entry {i}: count must be a positive integer, got {count!r}")
    return doc


def plan_workers(fleet: argparse.Namespace, groups: list[dict[str, Any]] | None,
                 parser: argparse.ArgumentParser | None = None, env: Any = None) -> list[WorkerPlan]:
    """One WorkerPlan per worker: the command line's serve flags, each group's flags over them,
    and the ports the fleet assigns. Raises PlanError (naming the flag or entry)."""
    from ..serve.config_file import mapping_args

    parser = parser or serve_parser()
    if groups is None:
        groups = [{"count": fleet.workers}]
    base = _common_namespace(fleet)
    known = parser._option_string_actions
    plans: list[WorkerPlan] = []
    names: set[str] = set()
    for gi, group in enumerate(groups):
        count = int(group.get("count", 1))
        flags = {str(k).replace("_", "-"): v for k, v in group.items() if k not in NAME_KEYS}
        for flag in flags:
            if "--" + flag in PER_WORKER_FLAGS:
                raise PlanError(f"--workers-config: entry {gi}: `{flag}` is assigned per worker; use "
                                f"{PER_WORKER_FLAGS['--' + flag]} (or leave the fleet to number them)")
        argv = mapping_args(flags, lambda f: f in known)
        for k in range(count):
            index = len(plans)
            name = _worker_name(fleet, group, k, count, index)
            if name in names:
                raise PlanError(f"--workers-config: two workers are named {name!r}")
            names.add(name)
            ns = copy.deepcopy(base)  # (no list of one worker's flags is another's)
            try:
                ns = parser.parse_args(argv, namespace=ns)
            except PlanError as e:
                raise PlanError(f"--workers-config: entry {gi} ({name}): {e}") from None
            for dest in ("_serve_parser", "_fleet_parser"):  # (the parsers: not part of a worker)
                if hasattr(ns, dest):
                    delattr(ns, dest)
            if "model" in group:
                ns.model_tag, ns.model_opt = str(group["model"]), None
            elif ns.model_tag is None:
                ns.model_tag = fleet.model_tag
            plans.append(WorkerPlan(index, name, ns))
    _assign_ports(fleet, plans, os.environ if env is None else env)
    return plans


def _worker_name(fleet: argparse.Namespace, group: dict[str, Any], k: int, count: int, index: int) -> str:
    if "name" in group:
        return str(group["name"]) if count == 1 else f"{group['name']}-{k}"
    return f"{fleet.name_prefix}-{index}"


def _common_namespace(fleet: argparse.Namespace) -> argparse.Namespace:
    """The fleet's parsed serve flags (those of every worker), without the fleet's own."""
    ns = copy.copy(fleet)
    for dest in FLEET_DESTS + ("_serve_parser", "_fleet_parser", "command"):
        if hasattr(ns, dest):
            delattr(ns, dest)
    ns.port = None  # assigned per worker
    if ns.uvicorn_log_level is None:  # uvicorn's start/stop lines, once per worker, only when asked for
        ns.uvicorn_log_level = "warning"
    ns.control_address = fleet.control_address_for_all
    return ns


FLEET_DESTS = ("ports_file", "workers", "base_port", "processes", "workers_config", "name_prefix", "control_base_port",
               "control_host", "kv_events_base_port", "fpm_base_port", "control_address_for_all")


def _engines(ns: argparse.Namespace) -> int:
    count = int(getattr(ns, "engine_count", 1) or 1)
    dp = getattr(ns, "data_parallel_size", None)
    return int(dp) if dp is not None and count == 1 else count


def _model(ns: argparse.Namespace) -> str:
    """The model a worker's KV events name: its first served name, else MODEL, else serve's default."""
    from ..frontend.tokenizer import DEFAULT_MODEL_NAME

    names = ns.served_model_name or [ns.model_opt or ns.model_tag or DEFAULT_MODEL_NAME]
    return names[0]


def _where(plan: WorkerPlan, env: Any) -> str:
    """The KV-event topic's middle part: <pod ip>:<port>, as llm-d's router subscribes (serve's
    entrypoint default), else the worker's name."""
    pod_ip = env.get("POD_IP")
    return f"{pod_ip}:{plan.args.port}" if pod_ip else plan.name


def _assign_ports(fleet: argparse.Namespace, plans: list[WorkerPlan], env: Any) -> None:
    kv_next, fpm_next = fleet.kv_events_base_port, fleet.fpm_base_port
    for value, flag in ((kv_next, "--kv-events-base-port"), (fpm_next, "--fpm-base-port")):
        if value == 0:
            raise PlanError(f"{flag}: 0 is not a base port (subscribers need to know where to connect)")
    for plan in plans:
        ns, i = plan.args, plan.index
        ns.port = fleet.base_port + i
        if fleet.base_port != 0 and ns.port > MAX_PORT:
            raise PlanError(f"--base-port: {fleet.base_port} + {len(plans)} workers runs past port {MAX_PORT}")
        if fleet.base_port == 0:
            ns.port = 0
        if fleet.control_base_port is not None and not ns.control_address:
            port = fleet.control_base_port + i if fleet.control_base_port else 0  # 0: any free port each
            if port > MAX_PORT:
                raise PlanError(f"--control-base-port: {fleet.control_base_port} + {len(plans)} workers runs past "
                                f"port {MAX_PORT}")
            host = f"[{fleet.control_host}]" if ":" in fleet.control_host else fleet.control_host
            ns.control_address = f"{host}:{port}"
        engines = _engines(ns)
        if kv_next is not None and ns.kv_events_config is None:
            if kv_next + engines - 1 > MAX_PORT:
                raise PlanError(f"--kv-events-base-port: {fleet.kv_events_base_port} runs past port {MAX_PORT}")
            ns.kv_events_config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://*:{kv_next}",
                                              "topic": f"kv@{_where(plan, env)}@{_model(ns)}"})
            kv_next += engines
        if fpm_next is not None and ns.forward_pass_metrics_port is None:
            if fpm_next + engines - 1 > MAX_PORT:
                raise PlanError(f"--fpm-base-port: {fleet.fpm_base_port} runs past port {MAX_PORT}")
            ns.forward_pass_metrics_port = fpm_next
            fpm_next += engines
    ports = [p.args.port for p in plans if p.args.port]
    if len(set(ports)) != len(ports):
        raise PlanError("--base-port: two workers would share a port")
    if fleet.control_base_port and fleet.base_port and set(ports) & {
            fleet.control_base_port + p.index for p in plans}:
        raise PlanError(f"--control-base-port: {fleet.control_base_port} + {len(plans)} workers overlaps the "
                        f"workers' ports from --base-port {fleet.base_port}")


def shard(plans: list[WorkerPlan], processes: int) -> list[list[WorkerPlan]]:
    """Workers in `processes` contiguous runs of (nearly) equal length: host k serves a range of ports."""
    n = max(1, min(processes, len(plans)))
    bounds = [len(plans) * k // n for k in range(n + 1)]
    return [plans[bounds[k]:bounds[k + 1]] for k in range(n)]


def write_ports_file(path: str, workers: list[dict[str, Any]]) -> None:
    """The ready fleet's workers (name, index, port, control_port, pid) as JSON, by index; written
    whole (to a temporary name, then renamed), so a reader never sees half of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"workers": sorted(workers, key=lambda w: w["index"])}, f, indent=1)
    os.replace(tmp, path)
