"""The conformance items that share a real stack run together (conftest.group_by_module_params),
so each stack starts once per module. Runs without the peers: it only collects."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


class _Recorder:
    def __init__(self) -> None:
        self.items: list = []

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, items):
        yield
        self.items = list(items)  # (after every reordering, the conftest's included)


def _collected(*files: str) -> list:
    rec = _Recorder()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *(str(HERE / f) for f in files)],
                       plugins=[rec])
    assert code == 0
    return rec.items


@pytest.mark.parametrize("module", ["test_play_tools.py", "test_play_constrained.py", "test_play_defaults.py"])
def test_each_stack_of_a_module_is_one_run_of_its_items(module):
    from .conftest import module_params

    items = _collected(module)
    keys = [module_params(item) for item in items]
    assert keys and all(keys)  # pytest still says which parameters are module-scoped (a private record)
    runs = [key for key, _ in itertools.groupby(keys)]
    assert len(runs) == len(set(runs)), f"{module}: a stack's items are split: {runs}"
    # the version is the outer key: one version's stacks all run before the other's
    versions = [dict((name, value) for _, name, value in key)["vllm_version"] for key in runs]
    assert len([v for v, _ in itertools.groupby(versions)]) == len(set(versions)) == 2


def test_the_other_modules_keep_their_places():
    items = _collected("test_play_tools.py", "test_serve_flags.py", "test_play_grammar.py")
    files = [item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1] for item in items]
    assert [f for f, _ in itertools.groupby(files)] == ["test_play_tools.py", "test_serve_flags.py",
                                                        "test_play_grammar.py"]
