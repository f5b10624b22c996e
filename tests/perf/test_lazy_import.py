"""perf/sdk_lean.py's deferred module on every CPython this project supports that the machine has:
an `import` statement leaves it unexecuted, the first use of a name executes it once (also when
threads use it at once, where the interpreter's own lazy module allows that), and it is then
the plain module. The standard library's lazy
module changed in 3.12.3 (a lock, and loading only a module whose class is exactly its own), so
the deferral is run under each interpreter found, not only the one running the suite."""

from __future__ import annotations

import glob
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
