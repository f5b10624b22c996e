"""The `vllm-vcr` command when a subcommand's module cannot be imported: running that subcommand
exits 1 with one line naming the subcommand, its module and the error (and the extra to install
when the missing module comes from one); `--help` still works and lists every subcommand, the
broken one marked unavailable with the reason; the other subcommands keep working."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from vllm_vcr import cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vllm_vcr"
SIMPLE_TRACE = ROOT / "tests" / "trace" / "fixtures" / "simple_trace.jsonl"


def _with(monkeypatch, **extra: str) -> None:
    """The real subcommand table plus `extra` (subcommand -> module)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {**cli.SUBCOMMANDS, **extra})


def _module(tmp_path: Path, monkeypatch, name: str, source: str) -> str:
    """A module `name` with `source`, importable for this test only."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_missing_subcommand_module_is_an_error_naming_it(monkeypatch, capsys):
    _with(monkeypatch, ghost="vllm_vcr_no_such_module")
    assert cli.main(["ghost"]) == 1
    line = _error_line(capsys)
    assert line == ("vllm-vcr: error: the 'ghost' subcommand is unavailable: vllm_vcr_no_such_module failed to "
                    "import: ModuleNotFoundError: No module named 'vllm_vcr_no_such_module'")


@pytest.mark.parametrize("argv", [["--help"], ["-h", "--flag"], ["--model", "m", "x"]])
def test_flags_after_an_unavailable_subcommand_get_the_same_error(monkeypatch, capsys, argv):
    _with(monkeypatch, ghost="vllm_vcr_no_such_module")
    assert cli.main(["ghost", *argv]) == 1
    assert "the 'ghost' subcommand is unavailable" in _error_line(capsys)


def test_an_import_error_inside_the_module_is_reported_with_its_message(tmp_path, monkeypatch, capsys):
    mod = _module(tmp_path, monkeypatch, "vcr_test_broken_sub", "from json import no_such_name\n")
    _with(monkeypatch, broken=mod)
    assert cli.main(["broken"]) == 1
    line = _error_line(capsys)
    assert line.startswith("vllm-vcr: error: the 'broken' subcommand is unavailable: vcr_test_broken_sub failed to "
                           "import: ImportError: cannot import name 'no_such_name' from 'json'")
    assert line.endswith("vcr_test_broken_sub.py:1)"), line  # where, since nothing is merely missing


def test_any_error_at_import_time_makes_the_subcommand_unavailable_not_the_command(tmp_path, monkeypatch, capsys):
    mod = _module(tmp_path, monkeypatch, "vcr_test_raising_sub", "X = 1\nraise RuntimeError('no 50% luck')\n")
    _with(monkeypatch, raising=mod)
    assert cli.main(["raising", "--x"]) == 1
    line = _error_line(capsys)
    assert "vcr_test_raising_sub failed to import: RuntimeError: no 50% luck (at " in line
    assert line.endswith("vcr_test_raising_sub.py:2)"), line
    # the rest of the command works as before
    assert cli.main(["inspect", "summarize", str(SIMPLE_TRACE)]) == 0
    assert "ttft" in capsys.readouterr().out.lower()
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert "raising" in capsys.readouterr().out  # '%' in the reason does not break argparse's help


@pytest.mark.parametrize("module,extra", sorted(cli.EXTRAS.items()))
def test_a_module_from_an_extra_names_the_extra_to_install(tmp_path, monkeypatch, capsys, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: `import module` raises
    mod = _module(tmp_path, monkeypatch, f"vcr_test_needs_{extra}", f"import {module}\n")
    _with(monkeypatch, fancy=mod)
    assert cli.main(["fancy"]) == 1
    line = _error_line(capsys)
    assert f"{mod} failed to import: ModuleNotFoundError: " in line and module in line
    assert line.endswith(f"(the '{extra}' extra provides it: pip install 'vllm-vcr[{extra}]')"), line


def test_a_missing_submodule_of_an_installed_extra_says_to_upgrade_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "vcr_test_extra_pkg").mkdir()
    (tmp_path / "vcr_test_extra_pkg" / "__init__.py").write_text("")
    monkeypatch.setitem(cli.EXTRAS, "vcr_test_extra_pkg", "demo")
    mod = _module(tmp_path, monkeypatch, "vcr_test_needs_newer", "import vcr_test_extra_pkg.newer\n")
    _with(monkeypatch, fancy=mod)
    assert cli.main(["fancy"]) == 1
    line = _error_line(capsys)
    assert line.endswith("ModuleNotFoundError: No module named 'vcr_test_extra_pkg.newer' (from the 'demo' extra, "
                         "installed without it: pip install -U 'vllm-vcr[demo]')"), line


def test_a_missing_module_of_no_extra_gets_no_install_hint(monkeypatch, capsys):
    _with(monkeypatch, ghost="vllm_vcr_no_such_module")
    cli.main(["ghost"])
    assert "pip install" not in _error_line(capsys)


def test_help_lists_every_subcommand_and_why_one_is_unavailable(monkeypatch, capsys):
    _with(monkeypatch, ghost="vllm_vcr_no_such_module")
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help column
    for name in cli.SUBCOMMANDS:
        assert re.search(rf"\s{re.escape(name)}\s", f" {out} "), name
    assert "ghost UNAVAILABLE: ModuleNotFoundError: No module named 'vllm_vcr_no_such_module'" in out
    assert out.count("UNAVAILABLE") == 1


def test_no_subcommand_of_this_checkout_is_unavailable():
    loaded, unavailable = cli.load_subcommands()
    assert not unavailable, {name: u.reason() for name, u in unavailable.items()}
    assert set(loaded) == set(cli.SUBCOMMANDS)
    parser, modules = cli.build_parser()
    assert set(modules) == set(cli.SUBCOMMANDS)


def test_unrecognized_arguments_of_a_working_subcommand_are_still_argparse_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", "summarize", str(SIMPLE_TRACE), "--no-such-flag"])
    assert e.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def _requirement_name(req: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", req).group(0)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_extras_table_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    core = {_canonical(_requirement_name(r)) for r in project["dependencies"]}
    for module, extra in cli.EXTRAS.items():
        assert _canonical(module) in {_canonical(_requirement_name(r)) for r in extras[extra]}, (module, extra)
    # every importable package only an extra installs (the test and bench extras are for this
    # repository's tests and benchmarks, not for a subcommand) is in the table
    runtime = {(_canonical(_requirement_name(r)), name) for name, reqs in extras.items()
               if name not in ("test", "bench") for r in reqs}
    table = {(_canonical(m), e) for m, e in cli.EXTRAS.items()}
    assert {(dist, extra) for dist, extra in runtime if dist not in core} == table


# ---- through the installed console script ----------------------------------------------------------

def _console_script() -> Path:
    (ep,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "vllm-vcr"] or [None]
    if ep is None:
        pytest.skip("vllm-vcr is not installed, so there is no console script: pip install -e .")
    assert ep.value == "vllm_vcr.cli:main"
    script = Path(sysconfig.get_path("scripts")) / "vllm-vcr"
    if not script.exists():
        found = shutil.which("vllm-vcr")
        if found is None:
            pytest.skip("the vllm-vcr console script is not on PATH: pip install -e .")
        script = Path(found)
    return script


@pytest.fixture(scope="module")
def broken_install(tmp_path_factory) -> Path:
    """A copy of this checkout's package on a temporary PYTHONPATH entry with two broken
    subcommands: pd-proxy's module imports a module that does not exist, and simulate's imports
    aiconfigurator_core, which (shadowed by a stub that raises) is missing."""
    root = tmp_path_factory.mktemp("broken-install")
    shutil.copytree(PACKAGE, root / "vllm_vcr", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "vllm_vcr" / "pd" / "cli.py").write_text("import vllm_vcr_missing_dependency\n")
    (root / "vllm_vcr" / "simulate" / "cli.py").write_text("import aiconfigurator_core\n")
    (root / "aiconfigurator_core.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'aiconfigurator_core'\", name='aiconfigurator_core')\n")
    return root


def _run(script: Path, root: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root)  # before site-packages: the copy shadows any installed vllm_vcr
    return subprocess.run([str(script), *argv], env=env, capture_output=True, text=True, timeout=60)


def test_console_script_reports_the_broken_subcommand(broken_install):
    script = _console_script()
    r = _run(script, broken_install, "pd-proxy", "--port", "1")
    assert r.returncode == 1, r
    assert r.stdout == ""
    assert r.stderr.splitlines() == [
        "vllm-vcr: error: the 'pd-proxy' subcommand is unavailable: vllm_vcr.pd.cli failed to import: "
        "ModuleNotFoundError: No module named 'vllm_vcr_missing_dependency'"], r.stderr

    r = _run(script, broken_install, "simulate", "--help")
    assert r.returncode == 1, r
    assert r.stderr.splitlines() == [
        "vllm-vcr: error: the 'simulate' subcommand is unavailable: vllm_vcr.simulate.cli failed to import: "
        "ModuleNotFoundError: No module named 'aiconfigurator_core' "
        "(the 'aic' extra provides it: pip install 'vllm-vcr[aic]')"], r.stderr


def test_console_script_help_lists_every_subcommand(broken_install):
    script = _console_script()
    r = _run(script, broken_install, "--help")
    assert r.returncode == 0, r
    out = " ".join(r.stdout.split())
    for name in cli.SUBCOMMANDS:
        assert re.search(rf"\s{re.escape(name)}\s", f" {out} "), name
    assert "pd-proxy UNAVAILABLE: ModuleNotFoundError: No module named 'vllm_vcr_missing_dependency'" in out
    assert "simulate UNAVAILABLE: ModuleNotFoundError: No module named 'aiconfigurator_core'" in out
    assert out.count("UNAVAILABLE") == 2
    # a subcommand that loaded still runs from the same broken install
    r = _run(script, broken_install, "inspect", "summarize", str(SIMPLE_TRACE))
    assert r.returncode == 0, r.stderr


def test_running_a_subcommand_imports_only_its_own_module():
    """Start-up: `vllm-vcr simulate ...` does not import serve's HTTP stack or the other adapters."""
    code = ("import sys\nfrom vllm_vcr import cli\n"
            "try:\n    cli.main(['simulate', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in cli.SUBCOMMANDS.values() if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['vllm_vcr.simulate.cli']"
    assert "--num-requests" in out.stdout

