"""The package's dependency rule, read from the source: no import cycles between modules, and
`engine/` imports none of the adapters nor the trace tools. Every import counts, including the
ones inside functions (a late import hides a cycle, it does not remove it); imports under
`if TYPE_CHECKING:` do not run, so they count for the engine rule but not for cycles between the
package's modules.

Inside `engine/` the rules are stricter: no cycle at all, not even through type-only imports
(core.py builds the helpers, which take narrow interfaces and never import it); no module reads
the environment (what the engine needs arrives in its config); and no module reads another
object's private attributes. The source checked is the imported package's, so
`PYTHONPATH=<tree>/src pytest tests/test_layout.py` checks that tree."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import vllm_vcr

SRC = Path(vllm_vcr.__file__).resolve().parents[1]
ENGINE = "vllm_vcr.engine"
# what engine/ must not import: the adapters and the trace tools built on top of it
NOT_FOR_ENGINE = ("http", "wire", "control", "pd", "kv_events", "fpm", "cli", "trace", "record", "replay", "inspect",
                  "frontend", "serve", "openai", "anthropic", "sglang", "vllm")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def imports_of(name: str, path: Path, modules: set[str]) -> Iterator[tuple[str, bool]]:
    """(imported module of the package, runs at run time) for every import in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = _type_checking_blocks(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` where c is not a module of ours
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, id(node) not in typing_only


def import_graph(root: Path, *, runtime_only: bool) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(paths)
    return {name: {t for t, runs in imports_of(name, p, modules) if runs or not runtime_only}
            for name, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def engine_violations(graph: dict[str, set[str]]) -> list[str]:
    banned = tuple(f"vllm_vcr.{p}" for p in NOT_FOR_ENGINE)
    return sorted(f"{mod} imports {dep}" for mod, deps in graph.items()
                  if mod == ENGINE or mod.startswith(ENGINE + ".")
                  for dep in deps if dep in banned or dep.startswith(tuple(b + "." for b in banned)))


# --- the checker itself can fail ---------------------------------------------------------------

def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    root = _write(tmp_path, {
        "vllm_vcr/__init__.py": "",
        "vllm_vcr/engine/__init__.py": "",
        "vllm_vcr/engine/core.py": "def load():\n    from ..trace.model import fit\n",
        "vllm_vcr/trace/__init__.py": "",
        "vllm_vcr/trace/model.py": "from vllm_vcr.engine import core\n",
        "vllm_vcr/wire/__init__.py": "",
        "vllm_vcr/wire/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "vllm_vcr/wire/b.py": "from . import a\n",
    })
    graph = import_graph(root, runtime_only=True)
    assert cycles(graph) == [["vllm_vcr.engine.core", "vllm_vcr.trace.model"]]  # not wire.a/b
    assert engine_violations(import_graph(root, runtime_only=False)) == [
        "vllm_vcr.engine.core imports vllm_vcr.trace.model"]


def test_checker_passes_a_clean_tree(tmp_path):
    root = _write(tmp_path, {
        "vllm_vcr/__init__.py": "",
        "vllm_vcr/engine/__init__.py": "",
        "vllm_vcr/engine/core.py": "from . import types\n",
        "vllm_vcr/engine/types.py": "import json\n",
        "vllm_vcr/http/__init__.py": "",
        "vllm_vcr/serve/app.py": "from ..engine.core import *\nimport vllm_vcr.engine.types\n",
    })
    assert cycles(import_graph(root, runtime_only=True)) == []
    assert engine_violations(import_graph(root, runtime_only=False)) == []


# --- the rule, on src/ ---------------------------------------------------------------------------

def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Imports between the top-level parts of vllm_vcr (engine, http, trace, ..., cli.py)."""
    def part(mod: str) -> str:
        return ".".join(mod.split(".")[:2])

    out: dict[str, set[str]] = {part(m): set() for m in graph}
    for mod, deps in graph.items():
        out[part(mod)].update(part(d) for d in deps if part(d) != part(mod) and part(d) != "vllm_vcr")
    return out


def test_no_import_cycles_between_modules():
    assert cycles(import_graph(SRC, runtime_only=True)) == []


def test_no_import_cycles_between_packages_outside_engine():
    packages = package_graph(import_graph(SRC, runtime_only=True))
    assert [c for c in cycles(packages) if ENGINE not in c] == []


def test_no_import_cycles_between_packages():
    assert cycles(package_graph(import_graph(SRC, runtime_only=True))) == []


def test_engine_imports_no_adapter_and_no_trace_tools():
    assert engine_violations(import_graph(SRC, runtime_only=False)) == []


# --- engine/: no cycle even through type-only imports, no environment, no private reads ---------

def engine_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles among engine/ modules, of a graph with every import (run-time and type-only)."""
    inside = {m for m in graph if m.startswith(ENGINE + ".")}
    return cycles({m: graph[m] & inside for m in inside})


# what reading the environment goes through: os.environ / os.getenv and their bytes forms, and
# the writers (a write is a read of the process's state by whatever reads it next)
ENV_NAMES = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})


def environment_reads(tree: ast.AST) -> list[str]:
    """Where a module touches the environment: `<x>.environ`, `<x>.getenv(...)` (any alias of os),
    `from os import environ` and the like. Comments and strings do not count (they are not code)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES:
            found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix", "nt"):
            found += [(node.lineno, f"line {node.lineno}: from {node.module} import {a.name}") for a in node.names
                      if a.name in ENV_NAMES or a.name == "*"]
    return [text for _, text in sorted(found)]


def _is_self(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: an object's own attributes."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_reads(tree: ast.AST) -> list[str]:
    """`x._name` where `x` is not self/cls/super(): a private attribute of another object
    (`__dunder__` names are public protocol)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not (node.attr.startswith("__") and node.attr.endswith("__")) and not _is_self(node.value):
            found.append((node.lineno, node.col_offset, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for *_, text in sorted(found)]


# engine module -> (attribute expression, why it may read another object's private attribute)
PRIVATE_READS_ALLOWED: dict[str, tuple[tuple[str, str], ...]] = {}


def engine_trees(root: Path) -> Iterator[tuple[str, ast.AST]]:
    engine = root / "vllm_vcr" / "engine"
    for path in sorted(engine.rglob("*.py")):
        yield str(path.relative_to(engine)), ast.parse(path.read_text(encoding="utf-8"))


def test_checker_finds_engine_rule_breaks(tmp_path):
    root = _write(tmp_path, {
        "vllm_vcr/__init__.py": "",
        "vllm_vcr/engine/core.py": "from . import helper\n",
        "vllm_vcr/engine/helper.py": ("from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from .core import Core\n"),
    })
    assert engine_cycles(import_graph(root, runtime_only=False)) == [["vllm_vcr.engine.core", "vllm_vcr.engine.helper"]]
    assert cycles(import_graph(root, runtime_only=True)) == []  # (the package-wide rule lets it pass)
    code = ("import os as o\nfrom os import getenv\n# os.environ in a comment\nDOC = 'os.environ'\n"
            "a = o.environ.get('X')\nb = getenv('Y')\n")
    assert environment_reads(ast.parse(code)) == ["line 2: from os import getenv", "line 5: o.environ"]
    code = ("class A:\n    def f(self, core):\n        self._x = core._y + super()._z() + self.__dict__.__len__()\n"
            "        return core.__class__, type(core)._w\n")
    assert private_reads(ast.parse(code)) == ["line 3: core._y", "line 4: type(core)._w"]


def test_no_import_cycles_in_engine_even_type_only():
    """core.py may import the helpers; a helper imports neither core.py nor anything that does."""
    assert engine_cycles(import_graph(SRC, runtime_only=False)) == []


def test_engine_reads_no_environment():
    """The engine's inputs arrive in its config (EngineArgs): the CLI and the adapters read the
    environment (e.g. PYTHONHASHSEED into EngineArgs.none_hash_seed)."""
    found = {name: reads for name, tree in engine_trees(SRC) if (reads := environment_reads(tree))}
    assert found == {}


def test_engine_reads_no_private_attribute_of_another_object():
    """Engine modules talk through public interfaces: no `other._name` beyond the allowlist."""
    found = {}
    for name, tree in engine_trees(SRC):
        allowed = {expr for expr, _why in PRIVATE_READS_ALLOWED.get(name, ())}
        reads = [r for r in private_reads(tree) if r.split(": ", 1)[1] not in allowed]
        if reads:
            found[name] = reads
    assert found == {}


def test_trace_is_a_leaf_library():
    """trace/ (schema, files, statistics) is used by record/, replay/, inspect/ and imports none of them."""
    packages = package_graph(import_graph(SRC, runtime_only=False))
    assert packages["vllm_vcr.trace"] == set()


# --- the layers of the front doors ----------------------------------------------------------------
# Who may import whom, type-only imports included: the frontend (tokens, templates, tools,
# structured outputs, logprobs, request checks) serves every front door and knows none of them;
# http/ is the ASGI toolkit the API families share; each family imports the frontend, http/ and
# the families below it; serve/ assembles them; wire/ (play) uses the frontend, never serve's HTTP.
FAMILIES = ("openai", "anthropic", "vllm", "sglang")
LAYERS: dict[str, tuple[str, ...]] = {
    "frontend": ("http", "serve", "wire", *FAMILIES),
    "http": ("serve", "wire", *FAMILIES),
    "openai": ("serve", "wire", "anthropic", "vllm", "sglang"),
    "anthropic": ("serve", "wire", "vllm", "sglang"),
    "vllm": ("serve", "wire", "sglang"),
    "sglang": ("serve", "wire"),
    "wire": ("http", "serve", *FAMILIES),
}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    packages = package_graph(graph)
    return sorted(f"{src} imports {dep}" for src, banned in LAYERS.items()
                  for dep in packages.get(f"vllm_vcr.{src}", ())
                  if dep.removeprefix("vllm_vcr.") in banned)


def test_the_front_door_layers_import_one_way():
    assert layer_violations(import_graph(SRC, runtime_only=False)) == []


def test_wire_imports_nothing_of_http():
    packages = package_graph(import_graph(SRC, runtime_only=False))
    assert "vllm_vcr.http" not in packages["vllm_vcr.wire"]
    assert "vllm_vcr.frontend" in packages["vllm_vcr.wire"]  # play's tokenizer and constraints


def test_layer_checker_finds_an_upward_import(tmp_path):
    root = _write(tmp_path, {
        "vllm_vcr/__init__.py": "",
        "vllm_vcr/frontend/__init__.py": "",
        "vllm_vcr/frontend/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..serve.app import App\n",
        "vllm_vcr/serve/__init__.py": "",
        "vllm_vcr/serve/app.py": "from ..frontend import a\n",
        "vllm_vcr/wire/__init__.py": "",
        "vllm_vcr/wire/b.py": "from ..http import sse\n",
        "vllm_vcr/http/__init__.py": "",
        "vllm_vcr/http/sse.py": "",
    })
    assert layer_violations(import_graph(root, runtime_only=False)) == [
        "frontend imports vllm_vcr.serve", "wire imports vllm_vcr.http"]
