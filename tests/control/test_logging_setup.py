"""The reloadable logging the vllm-vcr CLI installs."""

from __future__ import annotations

import logging

import pytest

from vllm_vcr import logging_setup


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.delenv("VLLM_VCR_LOG", raising=False)
    monkeypatch.delenv("RUST_LOG", raising=False)

    def install(default="info", **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        logging_setup.install_reloadable_logging(default)

    yield install
    logging_setup.uninstall_reloadable_logging()


def test_not_installed_by_default():
    assert not logging_setup.reloadable_logging_installed()


def test_install_logs_to_stderr_with_tracing_format(installed, capsys):
    installed()
    assert logging_setup.reloadable_logging_installed()
    log = logging.getLogger("vllm_vcr.engine")
    log.info("hello %s", "world")
    log.debug("not shown")
    err = capsys.readouterr().err
    assert " INFO vllm_vcr::engine: hello world" in err
    assert "not shown" not in err


@pytest.mark.parametrize(
    ("env", "engine_debug"),
    [({"RUST_LOG": "vllm_vcr::engine=debug,info"}, True),
     ({"VLLM_VCR_LOG": "info", "RUST_LOG": "debug"}, False),  # the project's variable wins
     ({"VLLM_VCR_LOG": "debug"}, True)],
)
def test_env_filter(installed, env, engine_debug):
    installed(**env)
    assert logging.getLogger("vllm_vcr.engine").isEnabledFor(logging.DEBUG) is engine_debug


def test_bad_env_falls_back_to_default_and_says_so(installed, capsys):
    installed(RUST_LOG="vllm_vcr=loud")
    assert logging.getLogger("vllm_vcr.engine").isEnabledFor(logging.INFO)
    assert not logging.getLogger("vllm_vcr.engine").isEnabledFor(logging.DEBUG)
    assert "ignoring RUST_LOG='vllm_vcr=loud'" in capsys.readouterr().err


def test_apply_changes_what_is_logged(installed, capsys):
    installed()
    log = logging.getLogger("vllm_vcr.engine.scheduler")
    assert logging_setup.apply_log_filter("vllm_vcr::engine=trace,info") == "vllm_vcr::engine=trace,info"
    log.log(logging_setup.TRACE, "a trace line")
    assert " TRACE vllm_vcr::engine::scheduler: a trace line" in capsys.readouterr().err
    with pytest.raises(logging_setup.LogFilterError):
        logging_setup.apply_log_filter("vllm_vcr=chatty")
    assert logging_setup.current_log_filter() == "vllm_vcr::engine=trace,info"  # unchanged
    logging_setup.apply_log_filter("error")
    log.warning("quiet now")
    assert "quiet now" not in capsys.readouterr().err
