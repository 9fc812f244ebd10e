"""Optional TLS on both front-ends and per-client rate limits, over real sockets on 127.0.0.1: the official
openai client over HTTPS (verifying a certificate made here), gRPC over TLS, and the limits' 429 /
RESOURCE_EXHAUSTED with a retry hint; plus the topology keys' errors."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from kvrelay.cluster.topology import TopologyError, parse_topology
from kvrelay.router.auth import ApiKeys
from kvrelay.router.client import RouterClient
from kvrelay.router.limits import RateLimiter, TlsFiles
from kvrelay.router.scripted_engine import ScriptedEngineClient
from kvrelay.router.server import BackgroundRouter
from kvrelay.router.types import SamplingOptions

MODEL = "gpt-oss-test"


def _self_signed(folder: Path) -> TlsFiles:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return TlsFiles(str(cert_file), str(key_file))


def test_https_and_grpc_over_tls(tmp_path) -> None:
    tls = _self_signed(tmp_path)
    engine = ScriptedEngineClient([[11, 12, 13, 14]], model_name=MODEL, max_context=4096)
    with BackgroundRouter(engine, tls=tls) as srv:
        assert srv.http_url.startswith("https://127.0.0.1:")
        http = httpx.Client(verify=ssl.create_default_context(cafile=tls.cert_file), timeout=30)
        with openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="unused", http_client=http, max_retries=0) as c:
            resp = c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4,
                                        extra_body={"return_token_ids": True})
            assert resp.choices[0].model_extra["token_ids"] == [11, 12, 13, 14]
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(f"{srv.http_url}/health", timeout=10)
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
            httpx.get(f"http://127.0.0.1:{srv.http_port}/health", timeout=10)

        with RouterClient(srv.grpc_target, timeout_s=30, tls_ca=tls.cert_file) as client:
            got = [t for r in client.generate([1, 2, 3], SamplingOptions(max_tokens=4)) for t in r.token_ids]
            assert got == [11, 12, 13, 14]
        with RouterClient(srv.grpc_target, timeout_s=10) as plain, pytest.raises(grpc.RpcError) as err:
            plain.health()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_rate_limit_per_key_on_both_front_ends() -> None:
    engine = ScriptedEngineClient([[11, 12]], model_name=MODEL, max_context=4096)
    limiter = RateLimiter(rpm=6, burst=2)  # one request per 10 s after a burst of 2
    with BackgroundRouter(engine, api_keys=ApiKeys(["sk-a", "sk-b"]), rate_limit=limiter) as srv:
        def post(key: str) -> httpx.Response:
            return httpx.post(f"{srv.http_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2}, timeout=30)

        assert [post("sk-a").status_code for _ in range(2)] == [200, 200]
        refused = post("sk-a")
        assert refused.status_code == 429 and 1 <= int(refused.headers["Retry-After"]) <= 10
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert post("sk-b").status_code == 200  # another key has its own bucket
        # A wrong key is refused by the key check, and does not use up anyone's requests.
        assert post("sk-wrong").status_code == 401
        # Probes and model lists are never limited.
        assert all(httpx.get(f"{srv.http_url}/health", timeout=10).status_code == 200 for _ in range(5))
        h = {"Authorization": "Bearer sk-a"}
        assert httpx.get(f"{srv.http_url}/v1/models", headers=h, timeout=10).status_code == 200
        # The official client retries a 429 by itself; without retries it raises RateLimitError.
        with openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="sk-a", max_retries=0) as c, \
                pytest.raises(openai.RateLimitError):
            c.completions.create(model=MODEL, prompt=[1], max_tokens=1)

        with RouterClient(srv.grpc_target, timeout_s=30, api_key="sk-b") as client:
            assert [t for r in client.generate([1], SamplingOptions(max_tokens=2)) for t in r.token_ids] == [11, 12]
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate([1], SamplingOptions(max_tokens=2)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in err.value.details()
            assert client.health().serving  # Health is not limited


def test_rate_limiter_refills_by_hand() -> None:
    now = [0.0]
    limiter = RateLimiter(rpm=60, burst=3, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(1.0)  # one request a second
    now[0] = 0.5
    assert limiter.take("a") == pytest.approx(0.5)
    now[0] = 1.0
    assert limiter.take("a") == 0.0 and limiter.take("b") == 0.0
    assert RateLimiter(rpm=600).burst == 100  # default burst: ten seconds' worth


BASE = "model: {name: tiny, dummy: true}\ndevice: cpu\n"


def test_topology_keys(tmp_path) -> None:
    tls = _self_signed(tmp_path)
    t = parse_topology(BASE + "router: {tls_cert_file: cert.pem, tls_key_file: key.pem, rate_limit_rpm: 120}\n",
                       source="x.yaml", base_dir=tmp_path)
    assert t.router.tls_cert_file == tls.cert_file and t.router.tls_key_file == tls.key_file
    assert t.router.rate_limit_rpm == 120 and t.router.rate_limit_burst is None
    for text, message in [
        ("router: {tls_cert_file: cert.pem}", "x.yaml: router.tls_key_file: required with router.tls_cert_file"),
        ("router: {tls_cert_file: nope.pem, tls_key_file: key.pem}", "x.yaml: router.tls_cert_file: 'nope.pem' is not a file"),
        ("router: {rate_limit_rpm: 0}", "x.yaml: router.rate_limit_rpm: must be > 0"),
        ("router: {rate_limit_burst: 5}", "x.yaml: router.rate_limit_burst: set router.rate_limit_rpm too"),
    ]:
        with pytest.raises(TopologyError) as err:
            parse_topology(BASE + text + "\n", source="x.yaml", base_dir=tmp_path)
        assert str(err.value).startswith(message), str(err.value)


def test_rate_limiter_forgets_idle_clients() -> None:
    now = [0.0]
    limiter = RateLimiter(rpm=60, burst=1, clock=lambda: now[0])
    for i in range(100_001):
        limiter.take(f"c{i}")
    assert len(limiter._buckets) == 100_001  # nobody has refilled yet
    now[0] = 5.0
    assert limiter.take("late") == 0.0
    assert len(limiter._buckets) == 1  # everyone refilled to a full bucket: forgotten, as good as new
    assert limiter.take("c0") == 0.0
