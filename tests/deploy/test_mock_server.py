"""MockServer (in-process and subprocess) and the vllm_vcr_server fixture's configuration paths."""

from __future__ import annotations

import socket
import tomllib

import httpx
import openai
import pytest

from vllm_vcr import MockServer, MockServerConfig, MockServerError
from tests.conftest import ROOT


def chat(server: MockServer, **kwargs):
    with server.openai_client(max_retries=0) as client:
        return client.chat.completions.create(model="vllm-vcr/sim", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=kwargs.pop("max_tokens", 4), **kwargs)


@pytest.mark.parametrize("run_in", ["thread", "subprocess"])
def test_both_runners_serve_count_and_patch(run_in):
    with MockServer(run_in=run_in, inter_token_latency=1, max_num_seqs=5) as server:
        assert server.config_now()["max_num_seqs"] == 5
        assert chat(server).choices[0].finish_reason == "length"
        assert server.stats()["requests_completed"] == 1
        assert server.reset_stats()["requests_received"] == 0
        patched = server.patch_config(failure_injection_rate=1.0, failure_types=["length"])
        assert patched["failure_injection_rate"] == 1.0
        assert chat(server, max_tokens=50).usage.completion_tokens < 50  # the injected failure ends it early
        port = server.port
    with pytest.raises(OSError):  # stopped: the port is closed
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_the_command_line_is_the_clis():
    cfg = MockServerConfig(model="acme/m", served_model_name=["a", "b"], failure_types=["error", "length"],
                           log_requests=False, time_to_first_token=7, extra_args=["--mode", "echo"])
    assert cfg.to_argv() == ["acme/m", "--served-model-name", "a", "b", "--time-to-first-token", "7",
                             "--failure-types", "error,length", "--no-log-requests", "--mode", "echo"]
    server = MockServer(cfg, seed=3)
    assert server.config.seed == 3 and server.config.model == "acme/m"
    assert server.argv()[:2] == ["serve", "acme/m"]


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(MockServerError, match="--max-num-seqs: must be >= 1"):
        MockServer(max_num_seqs=0).start()
    with pytest.raises(MockServerError, match="unrecognized arguments: --bogus"):
        MockServer(extra_args=["--bogus"], run_in="subprocess").start()
    with pytest.raises(MockServerError, match="did not start.*--served-model-name"):
        MockServer(served_model_name=[""]).start()
    with pytest.raises(MockServerError, match="not running"):
        MockServer().stats()


def test_mode_is_the_engines_output_mode_and_run_in_where_it_runs():
    with MockServer(mode="echo", inter_token_latency=1) as server:
        assert server.run_in == "thread"
        with server.openai_client(max_retries=0) as client:
            out = client.completions.create(model="vllm-vcr/sim", prompt="say it back", max_tokens=50)
        assert out.choices[0].text.startswith("say it back")  # (echo repeats the prompt up to max_tokens)
    with pytest.raises(ValueError, match="run_in='subprocess'"):
        MockServer(mode="subprocess")
    with pytest.raises(ValueError, match="run_in must be"):
        MockServer(run_in="random")


def _metric(server: MockServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("extra_args", [[], ["--api-server-count", "2"]], ids=["one-process", "api-servers"])
def test_fault_scripts_gauges_and_stats_in_one_call_each(extra_args):
    with MockServer(inter_token_latency=1, extra_args=extra_args, startup_timeout=120) as server:
        script = server.set_faults({"action": "http_error", "error": "unavailable", "count": 2})
        assert [r["remaining"] for r in script["rules"]] == [2]
        with server.openai_client(max_retries=0) as client:
            for _ in range(2):
                with pytest.raises(openai.APIStatusError) as e:
                    client.completions.create(model="vllm-vcr/sim", prompt="x", max_tokens=2)
                assert e.value.status_code == 503
            assert client.completions.create(model="vllm-vcr/sim", prompt="x", max_tokens=2).choices
        assert server.faults()["rules"] == []
        assert server.stats()["requests_completed"] == 1

        gauges = server.set_gauges(num_requests_waiting={"function": "constant", "value": 7},
                                   **{"vllm:kv_cache_usage_perc": {"function": "constant", "value": 0.5}})
        assert set(gauges) >= {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
        assert _metric(server, "vllm:num_requests_waiting") == 7
        assert _metric(server, "vllm:kv_cache_usage_perc") == 0.5
        server.clear_gauges()
        assert _metric(server, "vllm:num_requests_waiting") == 0
        with pytest.raises(MockServerError, match="422"):
            server.set_gauges(num_requests_waiting={"function": "zigzag"})


@pytest.mark.vllm_vcr(mode="echo", inter_token_latency=1,
                      faults=[{"action": "http_error", "error": "rate_limit", "count": 1}],
                      gauges={"num_requests_running": {"function": "constant", "value": 3}})
def test_fixture_takes_the_output_mode_faults_and_gauges(vllm_vcr_server):
    assert vllm_vcr_server.config.mode == "echo"
    assert _metric(vllm_vcr_server, "vllm:num_requests_running") == 3
    with vllm_vcr_server.openai_client(max_retries=0) as client:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="vllm-vcr/sim", prompt="hello", max_tokens=5)
        assert client.completions.create(model="vllm-vcr/sim", prompt="hello", max_tokens=5).choices[0].text \
            .startswith("hello")


def test_a_bad_patch_reports_the_control_apis_error():
    with MockServer() as server:
        with pytest.raises(MockServerError, match="400"):
            server.patch_config(failure_injection_rate=2.0)


async def test_async_context_manager_and_client():
    async with MockServer(model="m", inter_token_latency=1) as server:
        async with server.async_openai_client() as client:
            stream = await client.chat.completions.create(model="m", stream=True, max_tokens=5,
                                                          messages=[{"role": "user", "content": "x"}])
            chunks = [c async for c in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        async with httpx.AsyncClient() as http:
            assert (await http.get(server.url + "/health")).status_code == 200


@pytest.mark.vllm_vcr(model="marked", max_num_seqs=3)
def test_fixture_from_marker(vllm_vcr_server):
    assert vllm_vcr_server.config_now()["max_num_seqs"] == 3
    with vllm_vcr_server.openai_client() as client:
        assert [m.id for m in client.models.list().data] == ["marked"]


@pytest.mark.vllm_vcr(max_num_seqs=3, inter_token_latency=1)
@pytest.mark.parametrize("vllm_vcr_server", [{"max_num_seqs": 9}, MockServerConfig(max_num_seqs=11)],
                         indirect=True, ids=["dict", "config"])
def test_fixture_from_parameter_over_marker(vllm_vcr_server):
    config = vllm_vcr_server.config_now()
    assert config["max_num_seqs"] in (9, 11) and config["inter_token_latency"] == 1.0


def test_plugin_is_declared_as_a_pytest11_entry_point(request):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"]["vllm_vcr"] == "vllm_vcr.testing.pytest_plugin"
    assert project["scripts"]["vllm-vcr-entrypoint"] == "vllm_vcr.deploy.entrypoint:main"
    from importlib.metadata import entry_points

    installed = any(ep.name == "vllm_vcr" for ep in entry_points(group="pytest11"))
    # installed: pytest loaded it by the entry point's name; a stale install: tests/conftest.py did
    plugin = request.config.pluginmanager.get_plugin("vllm_vcr" if installed else "vllm_vcr.testing.pytest_plugin")
    assert plugin is not None and plugin.__name__ == "vllm_vcr.testing.pytest_plugin"


def test_docs_show_the_gateway_test_as_it_is():
    doc = (ROOT / "docs" / "testing.md").read_text()
    test = (ROOT / "tests" / "deploy" / "test_gateway_example.py").read_text()
    code = test[test.index("import itertools"):]
    assert "```python\n" + code + "```" in doc


def test_a_control_token_is_sent_by_the_helpers():
    with MockServer(extra_args=["--control-token", "t0k"], run_in="subprocess") as server:
        assert httpx.get(server.control_url + "/stats", timeout=10).status_code == 401
        assert server.stats()["requests_received"] == 0
        assert server.patch_config(inter_token_latency=3)["inter_token_latency"] == 3.0
