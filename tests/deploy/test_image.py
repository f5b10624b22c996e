"""The container image, built with scripts/build-image.sh and run with podman.

One container per test module (host network, free ports): /health, a streaming chat with the
openai SDK, the control API on the port MOCK_CONTROL_PORT names, the MOCK_* mapping visible in
GET /config, the health check, a non-root user, HTTPS with a mounted certificate, a SIGTERM that
lets the running stream end, and the image's size (under 200 MB).
Skipped with the reason where podman cannot run containers (`VLLM_VCR_IMAGE=0` skips it too).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port, scaled, wait_http_ok, wait_until

pytestmark = pytest.mark.image

TAG = "localhost/vllm-vcr:test"
BUILD = ROOT / "scripts" / "build-image.sh"
# as scripts/build-image.sh: the project's podman configuration where there is no systemd (CI containers)
PODMAN_ENV = dict(os.environ)
if "CONTAINERS_CONF" not in PODMAN_ENV and not Path("/run/systemd/system").is_dir():
    PODMAN_ENV["CONTAINERS_CONF"] = str(ROOT / "deploy" / "containers.conf")
MODEL = "acme/mock-7b"


def _podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=PODMAN_ENV, capture_output=True, text=True,
                          timeout=timeout, check=check)


@pytest.fixture(scope="module")
def image() -> str:
    if os.environ.get("VLLM_VCR_IMAGE") == "0":
        pytest.skip("VLLM_VCR_IMAGE=0")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (scripts/build-image.sh --prepare installs it as root)")
    check = subprocess.run(["bash", str(BUILD), "--check"], capture_output=True, text=True, timeout=600)
    if check.returncode != 0:
        pytest.skip(check.stderr.strip().splitlines()[-1] if check.stderr.strip() else "podman --check failed")
    build = subprocess.run(["bash", str(BUILD), "--tag", TAG], capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, f"scripts/build-image.sh failed:\n{build.stderr[-4000:]}"
    return TAG


class Container:
    def __init__(self, image: str, env: dict[str, str], *, volumes: tuple[str, ...] = (), args: tuple[str, ...] = ()):
        self.name = f"vllm-vcr-test-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.control_port = free_port()
        env = {"VLLM_PORT": str(self.port), "MOCK_CONTROL_PORT": str(self.control_port), **env}
        flags = [f"--env={k}={v}" for k, v in env.items()]
        # --network host: this machine kind has no container networking to rely on; --read-only
        # as the chart's readOnlyRootFilesystem (podman mounts a tmpfs on /tmp, the chart an emptyDir)
        mounts = [f"--volume={v}" for v in volumes]
        _podman("run", "-d", "--network", "host", "--read-only", "--name", self.name, *flags, *mounts, image,
                "serve", "--host", "127.0.0.1", *args)
        self.url = f"http://127.0.0.1:{self.port}"
        self.control = f"http://127.0.0.1:{self.control_port}"

    def wait_ready(self, timeout: float = 60) -> None:
        try:
            wait_http_ok(self.url + "/health", timeout,
                         lambda: None if self.running() else f"container exited:\n{self.logs()}", interval=0.2)
        except (TimeoutError, RuntimeError) as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None

    def running(self) -> bool:
        out = _podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return out.stdout.strip() == "true"

    def logs(self) -> str:
        out = _podman("logs", self.name, check=False)
        return out.stdout + out.stderr

    def remove(self) -> None:
        _podman("rm", "-f", "-t", "0", self.name, check=False)


@pytest.fixture(scope="module")
def container(image):
    c = Container(image, {"MODEL": MODEL, "MOCK_ITL_MS": "3", "MOCK_TTFT_MS": "5",
                          "MOCK_MAX_NUM_SEQS": "7", "MOCK_FAILURE_TYPES": "length",
                          "MOCK_KV_TRANSFER_LATENCY_MS": "10"})
    try:
        c.wait_ready()
        yield c
    finally:
        c.remove()


def test_image_metadata(image):
    inspect = json.loads(_podman("image", "inspect", image).stdout)[0]
    # docs/deploy.md: under 200 MB as podman and Docker count it (the layers, uncompressed)
    assert inspect["Size"] < 200_000_000, f"the image is {inspect['Size'] / 1e6:.1f} MB"
    config = inspect["Config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["MOCK_CONTROL_PORT"] == "8001"  # the control API on 127.0.0.1:8001 by default
    assert config["User"] == "10001"
    assert config["Entrypoint"] == ["vllm-vcr-entrypoint"] and config["Cmd"] == ["serve"]
    assert config["StopSignal"] == "SIGTERM"
    assert "vllm_vcr.deploy.healthcheck" in " ".join(inspect["Healthcheck"]["Test"])
    assert {"8000/tcp", "8001/tcp"} <= set(config["ExposedPorts"])


def test_streaming_chat_with_the_openai_sdk(container):
    from openai import OpenAI

    client = OpenAI(base_url=container.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    stream = client.chat.completions.create(model=MODEL, stream=True, max_tokens=12,
                                            messages=[{"role": "user", "content": "hi"}])
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
    assert chunks[-1].choices[0].finish_reason == "length"


def test_mock_environment_reaches_the_control_api(container):
    config = httpx.get(container.control + "/config", timeout=5).json()
    assert config["inter_token_latency"] == 3.0
    assert config["time_to_first_token"] == 5.0
    assert config["max_num_seqs"] == 7
    assert config["failure_types"] == ["length"]
    logs = container.logs()
    assert f"--control-address 127.0.0.1:{container.control_port}" in logs
    assert "MOCK_KV_TRANSFER_LATENCY_MS is ignored" in logs
    httpx.post(container.control + "/stats/reset", timeout=5).raise_for_status()
    httpx.post(container.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
               timeout=10).raise_for_status()
    assert httpx.get(container.control + "/stats", timeout=5).json()["requests_completed"] == 1


def test_health_check_and_non_root_user(container):
    health = _podman("healthcheck", "run", container.name, check=False)
    assert health.returncode == 0, health.stdout + health.stderr
    assert _podman("exec", container.name, "id", "-u").stdout.strip() == "10001"


def test_tokens_pass_through_the_environment_and_stay_out_of_the_logs(image):
    c = Container(image, {"MODEL": MODEL, "MOCK_CONTROL_TOKEN": "ctl-s3cret", "VLLM_API_KEY": "api-s3cret"})
    try:
        c.wait_ready()
        assert httpx.get(c.control + "/stats", timeout=5).status_code == 401
        ok = httpx.get(c.control + "/stats", headers={"authorization": "Bearer ctl-s3cret"}, timeout=5)
        assert ok.status_code == 200
        assert httpx.get(c.url + "/v1/models", timeout=5).status_code == 401
        assert httpx.get(c.url + "/v1/models", headers={"authorization": "Bearer api-s3cret"}, timeout=5).is_success
        assert "s3cret" not in c.logs()  # the entrypoint's command line and the server's own log lines
        health = _podman("healthcheck", "run", c.name, check=False)
        assert health.returncode == 0, health.stdout + health.stderr
    finally:
        c.remove()


def test_https_with_the_openai_sdk(image, tmp_path):
    """docs/deploy.md's HTTPS recipe: a certificate mounted read-only, vLLM's --ssl-keyfile and
    --ssl-certfile after `serve`; the openai SDK trusts only that certificate; the health check
    follows the server to HTTPS."""
    import ssl

    import openai

    from tests.http.test_serve_tls import make_cert

    tls = tmp_path / "tls"
    tls.mkdir()
    key, cert, _, _ = make_cert(tls, "server")
    key.chmod(0o644)  # the image's user (uid 10001) reads it
    tls.chmod(0o755)
    c = Container(image, {"MODEL": MODEL}, volumes=(f"{tls}:/tls:ro",),
                  args=("--ssl-keyfile", f"/tls/{key.name}", "--ssl-certfile", f"/tls/{cert.name}"))
    try:
        trusted = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=scaled(30))
        base = f"https://127.0.0.1:{c.port}"

        def up() -> bool:
            assert c.running(), c.logs()
            try:
                return trusted.get(base + "/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 60, "the container to answer over HTTPS", interval=0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", http_client=trusted)
        chat = client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        assert chat.usage.completion_tokens == 5
        stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) >= 1
        with pytest.raises(openai.APIConnectionError):  # a client without the certificate refuses it
            openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0).models.list()
        health = _podman("healthcheck", "run", c.name, check=False)
        assert health.returncode == 0, health.stdout + health.stderr
    finally:
        c.remove()


def test_sigterm_lets_the_running_stream_finish(image):
    c = Container(image, {"MODEL": MODEL, "MOCK_ITL_MS": "100"})
    try:
        c.wait_ready()
        result: dict[str, object] = {}

        def stream() -> None:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "stream": True}
            with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=30) as resp:
                result["lines"] = [line for line in resp.iter_lines() if line.startswith("data:")]

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + scaled(10)
        while httpx.get(c.control + "/stats", timeout=5).json()["running"] < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        t0 = time.monotonic()
        _podman("kill", "--signal", "TERM", c.name)
        exit_code = _podman("wait", c.name, timeout=40).stdout.strip()
        elapsed = time.monotonic() - t0
        t.join(10)
        assert exit_code == "0", c.logs()
        lines = result["lines"]
        assert lines[-1] == "data: [DONE]"  # drained: the stream ran to its end, not cut off
        assert json.loads(lines[-2][5:])["choices"][0]["finish_reason"] == "length"
        assert elapsed < scaled(20), f"took {elapsed:.1f}s to stop"
    finally:
        c.remove()


@pytest.mark.conformance
def test_play_in_the_image_behind_a_real_vllm_frontend(image, tmp_path):
    """docs/deploy.md's "play next to a real vLLM frontend": the frontend (here the real vLLM 0.32
    from the peers cache, on the host) and the image's `play` share the network namespace, as two
    containers of one pod share localhost."""
    from tests.conformance import peers

    reason = "VLLM_VCR_CONFORMANCE=0" if os.environ.get("VLLM_VCR_CONFORMANCE") == "0" else peers.missing_reason("0.32")
    if reason:
        pytest.skip(reason)
    http_port, rpc_port, control_port = free_port(), free_port(), free_port()
    env = peers.vllm_env("0.32")
    frontend = peers._spawn("vllm 0.32 frontend", [
        str(peers.venv("0.32") / "bin" / "vllm"), "serve", str(peers.MODEL_DIR), "--host", "127.0.0.1",
        "--port", str(http_port), "--data-parallel-size-local", "0", "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", str(rpc_port), "--max-model-len", "1024"], env, tmp_path / "frontend.log",
        cwd=tmp_path)
    name = f"vllm-vcr-play-{uuid.uuid4().hex[:8]}"
    _podman("run", "-d", "--network", "host", "--name", name, "-e", f"MOCK_HANDSHAKE_PORT={rpc_port}",
            "-e", f"MOCK_CONTROL_PORT={control_port}", "-e", "MOCK_ITL_MS=2", "-e", "MODEL=tiny",
            "-e", f"MOCK_EXTRA_ARGS=--vocab-size {peers.VOCAB_SIZE}", image, "play")
    try:
        deadline = time.monotonic() + scaled(240)
        while True:
            assert frontend.alive(), frontend.tail()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, frontend.tail() + _podman("logs", name, check=False).stderr
            time.sleep(0.5)
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
        out = client.completions.create(model=str(peers.MODEL_DIR), prompt="hello", max_tokens=6)
        assert out.usage.completion_tokens == 6
        assert httpx.get(f"http://127.0.0.1:{control_port}/stats", timeout=5).json()["requests_completed"] == 1
        health = _podman("healthcheck", "run", name, check=False)  # play: asked through its control API
        assert health.returncode == 0, health.stdout + health.stderr
    finally:
        _podman("rm", "-f", "-t", "5", name, check=False)
        frontend.stop(signal.SIGTERM, grace=15)


def test_installed_wheel_provides_the_fixture(image, tmp_path):
    """The wheel the image was built from, installed in a fresh virtual environment: pytest finds
    the vllm_vcr_server fixture by the package's entry point alone, for a test outside this repo."""
    cache = Path(os.environ.get("VLLM_VCR_IMAGE_CACHE") or Path.home() / ".cache" / "vllm-vcr" / "image")
    (wheel,) = (cache / "context" / "dist").glob("vllm_vcr-*.whl")
    venv = tmp_path / "venv"
    # the dependencies (and pytest) come from this interpreter's site-packages; no pip in the venv
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=120, capture_output=True)
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "tests" / "deploy" / "test_gateway_example.py", project)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_gateway_example.py"], cwd=project, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
