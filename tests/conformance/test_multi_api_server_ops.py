"""Differential, two API servers: the sleep, pause, weight-version and abort routes of dev mode sent
in the same order to (a) a real vLLM frontend run with `--api-server-count 2` (in front of
`vllm-vcr play --mode echo`) and (b) `vllm-vcr serve --api-server-count 2`, each with one
data-parallel rank and with two (`--data-parallel-size 2`). Status, JSON shape and
values must agree, step by step, unless the difference is on test_differential.ALLOWED.

Each step is a fresh connection, so the kernel spreads them over both API servers of each side:
state set through one API server (asleep, paused, the weight version) is read through either. Not
here: `/abort_requests` of a request in flight (it aborts only what the API server that answers
tracks, so the answer depends on which one the kernel picked) and runtime LoRA updating (vLLM
refuses VLLM_ALLOW_RUNTIME_LORA_UPDATING with more than one API server).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from vllm_vcr.serve.api_servers import API_SERVER_HEADER

from . import peers
from .test_differential import ENGINE_FLAGS, _call, _check, _start_sim, diff

pytestmark = pytest.mark.conformance

API_SERVERS = ["--api-server-count", "2"]
ENV = {"VLLM_SERVER_DEV_MODE": "1"}
HELD_FOR = 1.0  # s a request sent while paused or asleep must stay unanswered


@pytest.fixture(scope="module", params=[1, 2], ids=["1-engine", "2-engines"])
def engines(request) -> int:
    """Data-parallel ranks behind the two API servers: one, or two (each call then reaches both)."""
    return request.param


@pytest.fixture(scope="module")
def real_multi(vllm_version, engines):
    st = peers.start_stack(vllm_version, engine_count=engines, api_server_count=2, play_args=ENGINE_FLAGS,
                           frontend_env=ENV)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def sim_multi(tmp_path_factory, vllm_version, engines):
    st = _start_sim(tmp_path_factory, [*API_SERVERS, "--data-parallel-size", str(engines)], ENV, timeout=120)
    yield st
    st["proc"].stop()


COMPLETION = {"prompt": "later", "max_tokens": 3}


def _steps() -> list[tuple[str, str, str, object]]:
    """(name, method, path, body) in order. HOLD sends a completion in the background (it must not be
    answered while the engine is paused or asleep); JOIN waits for it after the step that lets it run."""
    return [
        ("is_sleeping", "GET", "/is_sleeping", None),
        ("is_paused", "GET", "/is_paused", None),
        ("weight_info", "GET", "/weight_info", None),
        ("update_weight_version", "POST", "/update_weight_version", {"new_version": "v7"}),
        ("weight_info_after_update", "GET", "/weight_info", None),
        ("weight_info_again", "GET", "/weight_info", None),
        # level 1, woken part by part
        ("sleep_1", "POST", "/sleep?level=1", None),
        ("is_sleeping_1", "GET", "/is_sleeping", None),
        ("is_sleeping_1_again", "GET", "/is_sleeping", None),
        ("is_paused_asleep", "GET", "/is_paused", None),
        ("sleep_state_1", "METRIC", "vllm:engine_sleep_state", None),
        ("sleep_again", "POST", "/sleep?level=1", None),
        ("held_while_asleep", "HOLD", "/v1/completions", COMPLETION),
        ("wake_weights", "POST", "/wake_up?tags=weights", None),
        ("is_sleeping_after_weights", "GET", "/is_sleeping", None),
        ("wake_weights_again", "POST", "/wake_up?tags=weights", None),
        ("wake_kv_cache", "POST", "/wake_up?tags=kv_cache", None),
        ("answer_after_wake", "JOIN", "", None),
        ("is_sleeping_awake", "GET", "/is_sleeping", None),
        ("sleep_state_awake", "METRIC", "vllm:engine_sleep_state", None),
        ("wake_when_awake", "POST", "/wake_up", None),
        # level 2 with mode=wait, one wake-up for everything
        ("sleep_2", "POST", "/sleep?level=2&mode=wait", None),
        ("is_sleeping_2", "GET", "/is_sleeping", None),
        ("wake_unknown_tag", "POST", "/wake_up?tags=nonsense", None),
        ("wake_all", "POST", "/wake_up", None),
        ("is_sleeping_after_2", "GET", "/is_sleeping", None),
        # level 0 pauses scheduling only
        ("sleep_0", "POST", "/sleep?level=0&mode=keep", None),
        ("is_sleeping_0", "GET", "/is_sleeping", None),
        ("is_paused_0", "GET", "/is_paused", None),
        ("wake_scheduling", "POST", "/wake_up?tags=scheduling", None),
        ("is_sleeping_after_0", "GET", "/is_sleeping", None),
        ("sleep_bad_level", "POST", "/sleep?level=3", None),
        ("sleep_bad_mode", "POST", "/sleep?mode=soon", None),
        # pause / resume in each mode
        ("pause_abort", "POST", "/pause?mode=abort", None),
        ("is_paused_abort", "GET", "/is_paused", None),
        ("is_sleeping_paused", "GET", "/is_sleeping", None),
        ("held_while_paused", "HOLD", "/v1/completions", COMPLETION),
        ("resume", "POST", "/resume", None),
        ("answer_after_resume", "JOIN", "", None),
        ("is_paused_resumed", "GET", "/is_paused", None),
        ("pause_wait", "POST", "/pause?mode=wait", None),
        ("is_paused_wait", "GET", "/is_paused", None),
        ("resume_wait", "POST", "/resume", None),
        ("pause_keep", "POST", "/pause?mode=keep&clear_cache=false", None),
        ("is_paused_keep", "GET", "/is_paused", None),
        ("pause_keep_again", "POST", "/pause?mode=keep", None),
        ("resume_keep", "POST", "/resume", None),
        ("resume_unpaused", "POST", "/resume", None),
        ("pause_bad_mode", "POST", "/pause?mode=soon", None),
        ("pause_bad_clear_cache", "POST", "/pause?clear_cache=maybe", None),
        ("is_paused_end", "GET", "/is_paused", None),
        # caches, aborts, the weight-transfer routes
        ("reset_prefix_cache", "POST", "/reset_prefix_cache", None),
        ("reset_prefix_cache_running", "POST", "/reset_prefix_cache?reset_running_requests=true", None),
        ("completion", "POST", "/v1/completions", COMPLETION),
        ("abort_all_idle", "POST", "/abort_requests", {}),
        ("abort_named", "POST", "/abort_requests", {"request_ids": ["a", "b"]}),
        ("abort_empty_list", "POST", "/abort_requests", {"request_ids": []}),
        ("abort_not_object", "POST", "/abort_requests", [1]),
        ("world_size", "GET", "/get_world_size", None),
        ("weight_checker_checksum", "POST", "/weight_checker", {"action": "checksum"}),
        ("init_weight_transfer", "POST", "/init_weight_transfer_engine", {"init_info": {}}),
        ("start_weight_update", "POST", "/start_weight_update", None),
        ("update_weights", "POST", "/update_weights", {"update_info": {}}),
        ("finish_weight_update", "POST", "/finish_weight_update", {"weight_version": "v8"}),
        ("weight_info_after_finish", "GET", "/weight_info", None),
        ("restore_weight_version", "POST", "/update_weight_version", {"new_version": "default"}),
        ("weight_info_restored", "GET", "/weight_info", None),
        ("is_sleeping_end", "GET", "/is_sleeping", None),
    ]


def _call_serve(base: str, method: str, path: str, body: object, answered_by: set[str]) -> tuple[int, object]:
    """test_differential._call, noting which of serve's API servers answered."""
    r = httpx.request(method, base + path, json=body, timeout=60)
    answered_by.add(r.headers.get(API_SERVER_HEADER, "?"))
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


class _Held:
    """A completion sent in the background; whether it was answered within HELD_FOR, then its answer."""

    def __init__(self, base: str, body: dict):
        self.result: tuple[int, object] | None = None
        self.thread = threading.Thread(target=self._run, args=(base, body), daemon=True)
        self.thread.start()

    def _run(self, base: str, body: dict) -> None:
        self.result = _call(base, "POST", "/v1/completions", body)

    def join(self) -> tuple[int, object]:
        self.thread.join(peers.scaled(60))
        return self.result if self.result is not None else (0, "no answer within 60 s")


def test_management_routes_match_with_two_api_servers(real_multi, sim_multi):
    findings: list[str] = []
    bases = (real_multi.base_url, sim_multi["base_url"])
    answered_by: set[str] = set()  # serve's API servers that answered (it names itself in a header)
    held: list[_Held] = []
    for name, method, path, body in _steps():
        if isinstance(body, dict) and path == "/v1/completions":
            body = {**body, "model": real_multi.model}
        if method == "HOLD":
            held = [_Held(base, body) for base in bases]
            time.sleep(HELD_FOR)
            early = [h.result for h in held]
            if early != [None, None]:
                findings.append(f"{name}: answered while it should wait: {early[0]!r:.120} in real, "
                                f"{early[1]!r:.120} in serve")
            continue
        if method == "JOIN":
            (sa, a), (sb, b) = (h.join() for h in held)
        elif method == "METRIC":
            (sa, a), (sb, b) = (_call(base, method, path, body) for base in bases)
        else:
            sa, a = _call(bases[0], method, path, body)
            sb, b = _call_serve(bases[1], method, path, body, answered_by)
        if sa != sb:
            findings.append(f"{name}: HTTP {sa} in real, {sb} in serve ({str(a)[:200]} vs {str(b)[:200]})")
            continue
        findings += [f"{name}: {d}" for d in diff(a, b)]
    assert answered_by >= {"0", "1"}, f"only serve's API server(s) {answered_by} answered: not two"
    _check(findings, real_multi.version)
