"""`serve --ssl-keyfile/--ssl-certfile` (and --ssl-ca-certs/--ssl-cert-reqs/--ssl-ciphers) as
vLLM's: HTTPS on --port, checked with the openai SDK over an httpx client that trusts a
self-signed certificate made here."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.conftest import ServeProcess, scaled, subprocess_env, wait_until


def make_cert(directory: Path, name: str, issuer: tuple[x509.Certificate, object] | None = None,
              ca: bool = False) -> tuple[Path, Path, x509.Certificate, object]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer_cert.subject if issuer_cert else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    key_path, cert_path = directory / f"{name}.key", directory / f"{name}.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path, cert, key


def start(tmp_path: Path, *args: str, client_cert: tuple[Path, Path] | None = None,
          verify: Path) -> ServeProcess:
    proc = ServeProcess(list(args), log_path=tmp_path / "serve.log")
    ctx = ssl.create_default_context(cafile=str(verify))
    if client_cert:
        ctx.load_cert_chain(str(client_cert[1]), str(client_cert[0]))

    def ready() -> bool:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"serve exited {proc.proc.returncode}:\n{proc.log()}")
        try:
            return httpx.get(f"https://127.0.0.1:{proc.port}/health", verify=ctx, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 60, "serve to answer over HTTPS", interval=0.1)
    except BaseException:
        proc.stop()
        raise
    return proc


def test_https_with_a_self_signed_certificate(tmp_path):
    key, cert, _, _ = make_cert(tmp_path, "server")
    proc = start(tmp_path, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), verify=cert)
    try:
        trusted = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)))
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{proc.port}/v1", api_key="x", http_client=trusted,
                               timeout=scaled(30))
        chat = client.chat.completions.create(model="vllm-vcr/sim", max_tokens=5,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
        stream = client.completions.create(model="vllm-vcr/sim", prompt="hi", max_tokens=4, stream=True)
        assert len([c for c in stream if c.choices]) >= 1
        # a client that does not trust the certificate is refused by its own TLS check
        with pytest.raises(openai.APIConnectionError):
            openai.OpenAI(base_url=f"https://127.0.0.1:{proc.port}/v1", api_key="x", max_retries=0).models.list()
        # plain HTTP on the TLS port gets no HTTP answer; the server keeps serving
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{proc.port}/health", timeout=5)
        assert trusted.get(f"https://127.0.0.1:{proc.port}/health").status_code == 200
        assert f"listening on https://127.0.0.1:{proc.port}" in proc.log()
    finally:
        assert proc.stop() == 0


def test_client_certificates_required(tmp_path):
    _, _, ca_cert, ca_key = make_cert(tmp_path, "ca", ca=True)
    ca_path = tmp_path / "ca.pem"
    key, cert, _, _ = make_cert(tmp_path, "server", issuer=(ca_cert, ca_key))
    ckey, ccert, _, _ = make_cert(tmp_path, "client", issuer=(ca_cert, ca_key))
    proc = start(tmp_path, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs", str(ca_path),
                 "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)), "--ssl-ciphers", "ECDHE+AESGCM",
                 client_cert=(ckey, ccert), verify=ca_path)
    try:
        ctx = ssl.create_default_context(cafile=str(ca_path))
        ctx.load_cert_chain(str(ccert), str(ckey))
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{proc.port}/v1", api_key="x",
                               http_client=httpx.Client(verify=ctx), timeout=scaled(30))
        assert [m.id for m in client.models.list().data] == ["vllm-vcr/sim"]
        anonymous = ssl.create_default_context(cafile=str(ca_path))
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"https://127.0.0.1:{proc.port}/health", verify=anonymous, timeout=5)
        assert client.models.list().data  # still serving
    finally:
        assert proc.stop() == 0


@pytest.mark.parametrize("args, flag", [
    (["--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-keyfile/--ssl-certfile"),
    (["--ssl-keyfile", "KEY"], "--ssl-certfile"),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-ciphers", "NO-SUCH-CIPHER"], "--ssl-ciphers"),
])
def test_bad_tls_flags_are_one_line_naming_the_flag(tmp_path, args, flag):
    key, cert, _, _ = make_cert(tmp_path, "server")
    args = [str(key) if a == "KEY" else str(cert) if a == "CERT" else a for a in args]
    out = subprocess.run([sys.executable, "-m", "vllm_vcr", "serve", "--host", "127.0.0.1", "--port", "0", *args],
                         capture_output=True, text=True, env=subprocess_env(), timeout=scaled(60))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "error" in lines[0], out.stderr


def test_the_image_health_check_asks_over_https(tmp_path, monkeypatch):
    from vllm_vcr.deploy import healthcheck

    key, cert, _, _ = make_cert(tmp_path, "server")
    proc = start(tmp_path, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), verify=cert)
    try:
        words = ["vllm-vcr", "serve", "--port", str(proc.port), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
        assert healthcheck.main(["serve"], words=words) == 0
        assert healthcheck.main(["serve"], words=[w for w in words if "ssl" not in w and w not in (str(key), str(cert))]) == 1
    finally:
        assert proc.stop() == 0
