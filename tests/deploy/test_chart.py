"""charts/vllm-vcr rendered by the real Helm library (helm-python-sdk, offline), linted, and every
manifest validated against the Kubernetes JSON schemas (kubernetes-validate ships them). The
engine containers' environment is then fed to the image's entrypoint and the `vllm-vcr` parser,
so a value that would not start a pod fails here."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.conftest import ROOT
from vllm_vcr.cli import build_parser
from vllm_vcr.deploy.entrypoint import build_argv
from vllm_vcr.engine_cli import control_address_from_env

helm = pytest.importorskip("helm_python", reason="helm-python-sdk, a test dependency: pip install 'vllm-vcr[test]'")
kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="kubernetes-validate, a test dependency: pip install 'vllm-vcr[test]'")

CHART = ROOT / "charts" / "vllm-vcr"
KUBE_VERSION = "1.33.0"
POD_IP, POD_NAME = "10.1.2.3", "sim-vllm-vcr-aggregated-abc12"


def example(name: str) -> dict:
    return yaml.safe_load((CHART / "examples" / f"{name}.yaml").read_text())


FLEET_WORKERS = "- name: fast\n  count: 3\n- name: sg\n  engine-type: sglang\n  time-to-first-token: 50\n"
VALUE_SETS = {
    "defaults": {},
    "llm-d": example("llm-d"),
    "disaggregated": example("disaggregated"),
    "replay": example("replay"),
    "inference-extension": example("inference-extension"),
    "sglang": {"engineType": "sglang", "inferencePool": {"enabled": True, "endpointPicker": {"name": "epp"}}},
    "everything-off": {"control": {"enabled": False}, "engine": {"logRequests": True, "extraArgs": ["--mode", "echo"]},
                       "roles": {"aggregated": {"env": [{"name": "MOCK_SEED", "value": "9"}],
                                                "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}}}}},
    "control-exposed": {"control": {"expose": True, "token": {"secretName": "sim-control", "secretKey": "tok"}}},
    "kv-events-bind": {"kvEvents": {"enabled": True}, "engine": {"dataParallelSize": 4}, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                       "replay": {"configMap": {"name": "my-traces"}, "latencyTrace": "cap.jsonl.gz"}},
    "fleet": {"fleet": {"enabled": True, "workers": 40, "processes": 2}, "kvEvents": {"enabled": True},
              "engine": {"interTokenLatencyMs": 20}},
    "fleet-config": {"fleet": {"enabled": True, "workersConfig": FLEET_WORKERS}},
}
# CRDs: kubernetes-validate has only the built-in kinds, so these are checked by the fields they must have
CRD_REQUIRED = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {"selector", "endpoints"},
    ("inference.networking.k8s.io/v1", "InferencePool"): {"selector", "targetPorts", "endpointPickerRef"},
}


def render(values: dict) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values=values, name="sim", namespace="default")
    docs = []
    for name, text in sorted(files.items()):
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(VALUE_SETS[request.param])


def test_lint_is_clean_for_every_value_set():
    for name, values in VALUE_SETS.items():
        report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
        assert not problems, f"{name}: {problems}"


def test_every_manifest_matches_the_kubernetes_schema(rendered):
    name, docs = rendered
    assert docs
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_REQUIRED:
            assert CRD_REQUIRED[key] <= set(doc["spec"]), f"{name}: {key} lacks {CRD_REQUIRED[key] - set(doc['spec'])}"
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _container_env(container: dict) -> dict[str, str]:
    """The env a pod sees: fieldRefs resolved, $(VAR) expanded from earlier variables (as kubelet does)."""
    fields = {"metadata.name": POD_NAME, "status.podIP": POD_IP, "metadata.namespace": "default"}
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item and "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            value = f"<secret {ref['name']}/{ref['key']}>"
        else:
            value = fields[item["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in item else item["value"]
        env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)
    return env


def _engine_args(deployment: dict):
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    argv = build_argv(container["args"], _container_env(container))
    parser, _ = build_parser()
    return parser.parse_args(argv)


def test_every_engine_pod_starts_with_the_values(rendered):
    name, docs = rendered
    for deployment in kinds(docs, "Deployment"):
        if deployment["metadata"]["name"].endswith("pd-proxy"):
            continue
        args = _engine_args(deployment)  # raises SystemExit on a flag the CLI rejects
        if name.startswith("fleet"):
            assert args.command == "fleet"
            continue
        assert args.command == "serve"
        assert args.side_channel_host == POD_IP


def test_llm_d_example_publishes_where_the_router_listens():
    docs = render(example("llm-d"))
    (deployment,) = kinds(docs, "Deployment")
    args = _engine_args(deployment)
    assert args.block_size == 64 and args.engine_count == 1
    assert args.kv_events_config == (
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://sim-epp.default.svc.cluster.local:5557", "topic": "kv@10.1.2.3:8000@Qwen/Qwen3-0.6B"}')
    (pool,) = kinds(docs, "InferencePool")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "sim-epp"
    assert labels["llm-d.ai/inferenceServing"] == "true"
    assert kinds(docs, "ServiceMonitor")


def test_disaggregated_has_prefill_decode_and_a_pd_proxy_in_front():
    docs = render(example("disaggregated"))
    deployments = {d["metadata"]["name"]: d for d in kinds(docs, "Deployment")}
    assert set(deployments) == {"sim-vllm-vcr-prefill", "sim-vllm-vcr-decode", "sim-vllm-vcr-pd-proxy"}
    prefill, decode = (_engine_args(deployments[f"sim-vllm-vcr-{r}"]) for r in ("prefill", "decode"))
    assert (prefill.worker_type, prefill.max_num_seqs, prefill.side_channel_port) == ("prefill", 16, 5600)
    assert (decode.worker_type, decode.max_num_seqs, decode.port) == ("decode", 256, 8200)
    assert prefill.inter_token_latency == decode.inter_token_latency == 20.0  # shared knobs
    proxy = deployments["sim-vllm-vcr-pd-proxy"]["spec"]["template"]["spec"]["containers"][0]
    parser, _ = build_parser()
    pargs = parser.parse_args(build_argv(proxy["args"], {}))
    assert pargs.prefill == ["http://sim-vllm-vcr-prefill:8000"] and pargs.decode == ["http://sim-vllm-vcr-decode:8200"]
    services = {s["metadata"]["name"]: s for s in kinds(docs, "Service")}
    assert services["sim-vllm-vcr"]["spec"]["selector"]["app.kubernetes.io/component"] == "pd-proxy"
    assert {"sim-vllm-vcr-prefill", "sim-vllm-vcr-decode", "sim-vllm-vcr-engines"} <= set(services)


def test_replay_table_comes_from_the_configmap():
    docs = render(example("replay"))
    (cm,) = kinds(docs, "ConfigMap")
    assert "greeting" in cm["data"]["table.jsonl"]
    (deployment,) = kinds(docs, "Deployment")
    assert _engine_args(deployment).response_replay_trace == "/etc/vllm-vcr/replay/table.jsonl"
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "replay", "configMap": {"name": cm["metadata"]["name"]}} in pod["volumes"]


def test_every_engine_knob_in_values_reaches_the_engine():
    knobs = {"timeToFirstTokenMs": ("time_to_first_token", 11.0), "interTokenLatencyMs": ("inter_token_latency", 3.0),
             "maxNumSeqs": ("max_num_seqs", 5), "maxNumBatchedTokens": ("max_num_batched_tokens", 99),
             "kvCacheSize": ("kv_cache_size", 77), "blockSize": ("block_size", 32),
             "schedulingPolicy": ("scheduling_policy", "priority"), "failureTypes": ("failure_types", "length"),
             "failureInjectionRate": ("failure_injection_rate", 0.5), "timeScale": ("time_scale", 2.0),
             "shutdownTimeoutSeconds": ("shutdown_timeout", 5.0), "dataParallelSize": ("engine_count", 3),
             "maxModelLen": ("max_model_len", 8192), "seed": ("seed", 4), "logRequests": ("log_requests", True),
             "timeToFirstTokenStdDevMs": ("time_to_first_token_std_dev", 1.0),
             "interTokenLatencyStdDevMs": ("inter_token_latency_std_dev", 1.0),
             "prefillOverheadMs": ("prefill_overhead", 2.0), "prefillTimePerTokenMs": ("prefill_time_per_token", 0.5),
             "prefillTimeStdDevMs": ("prefill_time_std_dev", 0.25), "timeFactorUnderLoad": ("time_factor_under_load", 1.5),
             "longPrefillTokenThreshold": ("long_prefill_token_threshold", 64)}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["engine"]
    assert set(knobs) == set(defaults) - {"extraArgs"}
    (deployment,) = kinds(render({"engine": {k: v for k, (_, v) in knobs.items()}}), "Deployment")
    args = _engine_args(deployment)
    for key, (attr, value) in knobs.items():
        assert getattr(args, attr) == value, key


def test_every_engine_pod_is_labelled_with_its_engine_type():
    """The endpoint picker chooses the metric names it scrapes by the pod's llm-d.ai/engine-type."""
    for engine_type in ("vllm", "sglang"):
        for mode in ("aggregated", "disaggregated"):
            for deployment in kinds(render({"engineType": engine_type, "mode": mode}), "Deployment"):
                if deployment["metadata"]["name"].endswith("pd-proxy"):
                    continue
                labels = deployment["spec"]["template"]["metadata"]["labels"]
                assert labels["llm-d.ai/engine-type"] == engine_type
                assert _engine_args(deployment).engine_type == engine_type
    (deployment,) = kinds(render({}), "Deployment")  # the default is vLLM
    assert deployment["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"


def test_inference_extension_example_matches_the_endpoint_picker_values():
    """deploy/inference-extension/epp-values.yaml (the inferencepool chart's values) selects exactly
    the pods charts/vllm-vcr/examples/inference-extension.yaml makes, on their port, with their
    engine type."""
    epp = yaml.safe_load((ROOT / "deploy" / "inference-extension" / "epp-values.yaml").read_text())
    docs = render(example("inference-extension"))
    (deployment,) = kinds(docs, "Deployment")
    pod = deployment["spec"]["template"]
    pool = epp["inferencePool"]
    assert pool["modelServers"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {t["number"] for t in pool["targetPorts"]} <= ports
    assert pool["modelServerType"] == pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    assert _engine_args(deployment).block_size == 16
    assert epp["inferenceExtension"]["metricsDataSource"]["path"] == "/metrics"
    assert epp["inferenceExtension"]["flags"]["refresh-metrics-interval"] == "50ms"


def test_bad_values_fail_with_a_message():
    with pytest.raises(helm.HelmError, match="engineType must be vllm or sglang"):
        render({"engineType": "trtllm"})
    with pytest.raises(helm.HelmError, match="mode must be aggregated or disaggregated"):
        render({"mode": "both"})
    with pytest.raises(helm.HelmError, match="endpointPicker.name"):
        render({"inferencePool": {"enabled": True}})


def _control_exposure(values: dict) -> tuple[dict[str, str], list[str], list[str]]:
    docs = render(values)
    (deployment,) = kinds(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    engines = next(d for d in kinds(docs, "Service") if d["metadata"]["name"].endswith("-engines"))
    return (_container_env(container), [p["name"] for p in container["ports"]],
            [p["name"] for p in engines["spec"]["ports"]])


def test_the_control_api_stays_in_the_pod_unless_exposed():
    env, ports, service = _control_exposure({})
    assert env["MOCK_CONTROL_PORT"] == "8001" and "MOCK_CONTROL_HOST" not in env and "MOCK_CONTROL_TOKEN" not in env
    assert "control" not in ports and "control" not in service
    assert control_address_from_env(env) == "127.0.0.1:8001"  # reachable by kubectl port-forward only

    env, ports, service = _control_exposure(VALUE_SETS["control-exposed"])
    assert env["MOCK_CONTROL_HOST"] == "0.0.0.0" and env["MOCK_CONTROL_TOKEN"] == "<secret sim-control/tok>"
    assert "control" in ports and "control" in service
    assert control_address_from_env(env) == "0.0.0.0:8001"

    env, ports, service = _control_exposure({"control": {"enabled": False, "expose": True,
                                                         "token": {"secretName": "s"}}})
    assert env["MOCK_CONTROL_PORT"] == "off" and "MOCK_CONTROL_HOST" not in env and "MOCK_CONTROL_TOKEN" not in env
    assert "control" not in ports and "control" not in service



def test_a_fleet_per_pod():
    """fleet.enabled: each pod runs `vllm-vcr fleet`; worker i on 8000 + i, its control API on
    18000 + i, its KV events on 5556 + i; the pod's name and namespace reach the identity headers."""
    from vllm_vcr.fleet.cli import _check_fleet_flags
    from vllm_vcr.fleet.plan import plan_workers

    docs = render(VALUE_SETS["fleet"])
    (deployment,) = kinds(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = _container_env(container)
    assert (env["POD_NAME"], env["POD_NAMESPACE"]) == (POD_NAME, "default")
    args = _engine_args(deployment)
    assert (args.workers, args.processes, args.base_port, args.inter_token_latency) == (40, 2, 8000, 20.0)
    assert [p["containerPort"] for p in container["ports"] if 8000 <= p["containerPort"] < 8100] == list(range(8000, 8040))
    _check_fleet_flags(args)
    plans = plan_workers(args, None, env=env)
    assert [p.args.port for p in plans] == list(range(8000, 8040))
    assert plans[3].args.control_address == "127.0.0.1:18003"
    assert '"endpoint": "tcp://*:5559"' in plans[3].args.kv_events_config

    docs = render(VALUE_SETS["fleet-config"])
    (deployment,) = kinds(docs, "Deployment")
    (cm,) = [d for d in kinds(docs, "ConfigMap") if d["metadata"]["name"].endswith("-fleet")]
    assert cm["data"]["workers.yaml"] == FLEET_WORKERS
    args = _engine_args(deployment)
    assert args.workers is None and args.workers_config == "/etc/vllm-vcr/fleet/workers.yaml"
    mounts = deployment["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "fleet", "mountPath": "/etc/vllm-vcr/fleet", "readOnly": True} in mounts
