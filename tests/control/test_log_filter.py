"""EnvFilter parsing and its mapping onto Python logging levels."""

from __future__ import annotations

import logging

import pytest

from vllm_vcr.log_filter import OFF, TRACE, LogFilterError, LoggingLevels, parse_log_filter


@pytest.mark.parametrize(
    ("spec", "default", "targets"),
    [
        ("info", logging.INFO, {}),
        ("INFO", logging.INFO, {}),
        ("Warn", logging.WARNING, {}),
        ("off", OFF, {}),
        ("trace", TRACE, {}),
        ("5", TRACE, {}),
        ("0", OFF, {}),
        ("vllm_vcr::engine=trace,info", logging.INFO, {"vllm_vcr.engine": TRACE}),
        ("warn,vllm_vcr::http=debug", logging.WARNING, {"vllm_vcr.http": logging.DEBUG}),
        (" vllm_vcr::engine = DEBUG , error ", logging.ERROR, {"vllm_vcr.engine": logging.DEBUG}),
        ("vllm_vcr::engine", OFF, {"vllm_vcr.engine": TRACE}),  # bare target = trace; no default = off
        ("vllm_vcr.engine=info", OFF, {"vllm_vcr.engine": logging.INFO}),  # Python spelling accepted
        ("info,debug", logging.DEBUG, {}),  # the later bare level wins
        ("vllm_vcr=info,vllm_vcr=error,info", logging.INFO, {"vllm_vcr": logging.ERROR}),
        ("my-crate::a_b=3,", OFF, {"my-crate.a_b": logging.INFO}),
        ("verbose", OFF, {"verbose": TRACE}),  # not a level, so a target, as in EnvFilter
    ],
)
def test_parse(spec, default, targets):
    f = parse_log_filter(spec)
    assert f.default == default
    assert f.targets == targets


@pytest.mark.parametrize(
    "spec",
    ["", " , ", "vllm_vcr=verbose", "vllm_vcr::engine=loud", "=info", "vllm_vcr::=info", "a b=info",
     "vllm_vcr[span]=debug", "[{field=1}]=trace", "vllm_vcr=", "vllm_vcr=6", "a::b::=info"],
)
def test_parse_errors(spec):
    with pytest.raises(LogFilterError):
        parse_log_filter(spec)


def test_most_specific_target_wins():
    f = parse_log_filter("vllm_vcr=warn,vllm_vcr::engine=trace,error")
    assert f.level_for("vllm_vcr.engine.core") == TRACE
    assert f.level_for("vllm_vcr.engine") == TRACE
    assert f.level_for("vllm_vcr.engineer") == logging.WARNING  # module boundary, not a string prefix
    assert f.level_for("vllm_vcr.http") == logging.WARNING
    assert f.level_for("uvicorn.error") == logging.ERROR


def test_canonical_string_round_trips():
    f = parse_log_filter("vllm_vcr::engine=TRACE, 3")
    assert f.to_string() == "vllm_vcr::engine=trace,info"
    assert parse_log_filter(f.to_string()) == f


@pytest.fixture
def levels():
    root = logging.getLogger()
    saved = root.level
    lv = LoggingLevels()
    yield lv
    lv.reset()
    root.setLevel(saved)


def test_apply_sets_and_undoes_logger_levels(levels):
    levels.apply(parse_log_filter("vllm_vcr::engine=trace,warn"))
    eng = logging.getLogger("vllm_vcr.engine.core")
    assert eng.isEnabledFor(TRACE)
    assert not logging.getLogger("vllm_vcr.http").isEnabledFor(logging.INFO)
    assert logging.getLogger("vllm_vcr.http").isEnabledFor(logging.WARNING)

    levels.apply(parse_log_filter("info"))
    assert logging.getLogger("vllm_vcr.engine").level == logging.NOTSET  # previous target undone
    assert not eng.isEnabledFor(logging.DEBUG)
    assert eng.isEnabledFor(logging.INFO)

    levels.apply(parse_log_filter("off"))
    assert not eng.isEnabledFor(logging.CRITICAL)
