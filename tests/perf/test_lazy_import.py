"""perf/sdk_lean.py's deferred module on every CPython this project supports that the machine has:
an `import` statement leaves it unexecuted, the first use of a name executes it once (also when
threads use it at once, where the interpreter's own lazy module allows that), and it is then
the plain module. The standard library's lazy
module changed in 3.12.3 (a lock, and loading only a module whose class is exactly its own), so
the deferral is run under each interpreter found, not only the one running the suite."""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

LEAN = Path(__file__).resolve().parents[2] / "src" / "vllm_vcr" / "perf" / "sdk_lean.py"

_PROBE = """
import importlib.util, sys, threading
spec = importlib.util.spec_from_file_location("sdk_lean_probe", sys.argv[1])
lean = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lean)  # (the standard library only at its top: no project import)
sys.path.insert(0, sys.argv[2])
lean._defer("probe_pkg")
import probe_pkg as p
assert "probe_pkg.sub" not in sys.modules, "an import statement executed it"
values = []
# (two threads' first uses at once are safe where the standard library's lazy module is: 3.12.3 on)
threads = [threading.Thread(target=lambda: values.append(p.VALUE))
           for _ in range(4 if sys.version_info >= (3, 12, 3) else 1)]
for t in threads: t.start()
for t in threads: t.join()
assert values and set(values) == {42}, values
import probe_pkg
assert probe_pkg is p and type(p).__name__ == "module" and sys.modules["probe_pkg"] is p
assert sys.modules["_probe_runs"] == [1], sys.modules["_probe_runs"]  # executed once
print("ok")
"""


def _interpreters() -> list[str]:
    found = {os.path.realpath(sys.executable): sys.executable}
    roots = [os.path.expanduser("~/.pyenv/versions/3.1[1-9]*/bin/python3"), "/usr/bin/python3.1[1-9]",
             "/usr/local/bin/python3.1[1-9]"]
    for pattern in roots:
        for path in sorted(glob.glob(pattern)):
            if os.access(path, os.X_OK):
                found.setdefault(os.path.realpath(path), path)
    return sorted(found.values())


@pytest.mark.parametrize("python", _interpreters())
def test_a_deferred_module_executes_once_at_its_first_use(python, tmp_path):
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import sys\nsys.modules.setdefault('_probe_runs', []).append(1)\n"
        "from probe_pkg import sub\nVALUE = sub.X + 1\n")
    (pkg / "sub.py").write_text("X = 41\n")
    out = subprocess.run([python, "-c", _PROBE, str(LEAN), str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0 and out.stdout.strip() == "ok", (python, out.stdout, out.stderr[-2000:])


_NETWORK = """
import sys
from vllm_vcr.perf.sdk_lean import defer_network
defer_network()
import aiconfigurator_core.sdk.utils as utils  # (imports urllib.request at its top)
assert "http.client" not in sys.modules, "urllib.request was executed by an import statement"
import urllib.request
assert urllib.request is sys.modules["urllib.request"] is utils.urllib.request
request = utils.urllib.request.Request("http://127.0.0.1:9/x")  # a first use executes it
assert "http.client" in sys.modules and request.full_url == "http://127.0.0.1:9/x"
from urllib.request import urlopen
import urllib.error
assert callable(urlopen) and issubclass(urllib.error.HTTPError, OSError)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None, reason="the aic extra is not installed")
def test_the_sdks_network_module_is_deferred_and_works_at_its_first_use():
    """perf/sdk_lean.py `defer_network`: the SDK's `import urllib.request` leaves it unexecuted (and
    http.client unloaded); its names, the package attribute and `from ... import` still work."""
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run([sys.executable, "-c", _NETWORK], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(src)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.stdout, out.stderr[-2000:])
