"""The reliability suite: short versions run by default; `long` ones only with `-m long` (or
VLLM_VCR_LONG=1), on a machine nothing else is using."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    wanted = "long" in (config.option.markexpr or "") or os.environ.get("VLLM_VCR_LONG") == "1"
    if wanted:
        return
    skip = pytest.mark.skip(reason="long reliability run: use -m long or VLLM_VCR_LONG=1")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    from tests.reliability.hostile import FIGURES

    if FIGURES:
        terminalreporter.section("stream fuzzing")
        for name in sorted(FIGURES):
            terminalreporter.write_line(f"{name}: {FIGURES[name]:g}")
