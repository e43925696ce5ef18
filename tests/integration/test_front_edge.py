"""The HTTP front of a real hybrid node: HTTPS with ``--api-key``, and no stall on 10 MB.

* HTTPS: a certificate the test generates, ``--ssl-keyfile``/``--ssl-certfile``,
  the openai SDK over https with the key (and a 401 without it).
* Stall: 8 streams run while a 10 MB prompt arrives; their largest
  inter-token gap stays under 2x their unloaded p99 (tokens every 50 ms, so
  the margin is wide; before the fix the streams froze for seconds). Twice:
  with the checkpoint's 2048-token context the body is refused (413) from its
  ``Content-Length``; with a 1M-token context (and ``--max-request-bytes``
  raised) it is read, parsed and tokenized in a worker thread, then refused
  (400) by its exact token count.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mlxcel_plugin.local_cluster import LOOPBACK, free_port

REPO = Path(__file__).resolve().parents[2]
MODEL = "edge"
KEY = "sk-edge-test"
STREAMS = 8
STEP_S = 0.05

pytestmark = pytest.mark.timeout(300)


def write_certificate(workdir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (also its own CA): (key, cert) paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mlxcel test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOOPBACK))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    key_path, cert_path = workdir / "server.key", workdir / "server.crt"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def fake_model_dir(root: Path, tiny: Path, context_tokens: int | None = None) -> Path:
    """The tiny checkpoint's tokenizer with the ``fake`` engine: a token every STEP_S."""
    root.mkdir(parents=True, exist_ok=True)
    for item in tiny.iterdir():
        if item.is_file() and item.suffix in (".json", ".txt", ".jinja"):
            shutil.copy(item, root / item.name)
    (root / "fake_engine.json").write_text(json.dumps({"decode_step_s": STEP_S}))
    if context_tokens is not None:  # the context the front reads from config.json
        config = json.loads((root / "config.json").read_text())
        (root / "config.json").write_text(json.dumps({**config,
                                                      "max_position_embeddings": context_tokens}))
    return root


class Hybrid:
    def __init__(self, workdir: Path, model_dir: Path, extra: list[str], scheme: str,
                 verify: ssl.SSLContext | bool = False):  # fmt: skip
        self.port = free_port()
        self.url = f"{scheme}://{LOOPBACK}:{self.port}"
        self.verify = verify
        self.log_path = workdir / f"hybrid-{self.port}.log"
        argv = [sys.executable, "-m", "mlxcel_plugin.cli", "--engine", "fake", "--model",
                str(model_dir), "--served-model-name", MODEL, "--port", str(self.port),
                "--no-warmup", *extra]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def wait_ready(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # bounded by the deadline
            if self.process.poll() is not None:
                raise RuntimeError(f"hybrid exited:\n{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", verify=self.verify, timeout=1).is_success:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.1)
        raise TimeoutError("hybrid did not come up")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture(scope="module")
def model_dir(tiny_model_path: Path, tmp_path_factory) -> Path:
    return fake_model_dir(tmp_path_factory.mktemp("edge-model"), tiny_model_path)


@pytest.fixture(scope="module")
def https_hybrid(model_dir: Path, tmp_path_factory) -> Iterator[Hybrid]:
    workdir = tmp_path_factory.mktemp("edge-tls")
    key_path, cert_path = write_certificate(workdir)
    extra = ["--api-key", KEY, "--api-key", "sk-other", "--ssl-keyfile", str(key_path),
             "--ssl-certfile", str(cert_path)]  # fmt: skip
    node = Hybrid(workdir, model_dir, extra, "https",
                  verify=ssl.create_default_context(cafile=str(cert_path)))
    try:
        node.wait_ready()
        yield node
    finally:
        node.stop()


def test_openai_sdk_over_https_with_a_key(https_hybrid: Hybrid) -> None:
    def client(key: str) -> openai.OpenAI:
        http = httpx.Client(verify=https_hybrid.verify)
        return openai.OpenAI(base_url=f"{https_hybrid.url}/v1", api_key=key, max_retries=0,
                             http_client=http)  # fmt: skip

    messages = [{"role": "user", "content": "Hi"}]
    with client(KEY) as sdk:
        reply = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
        stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                             stream=True)  # fmt: skip
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    with client("sk-wrong") as sdk, pytest.raises(openai.AuthenticationError) as refused:
        sdk.models.list()
    assert refused.value.status_code == 401
    assert httpx.get(f"{https_hybrid.url}/health", verify=https_hybrid.verify).is_success
    with pytest.raises(httpx.TransportError):  # plain HTTP is not served on the TLS port
        httpx.get(https_hybrid.url.replace("https", "http") + "/health", timeout=5)


async def stream_gaps(client: httpx.AsyncClient, max_tokens: int) -> list[float]:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Count."}]}  # fmt: skip
    gaps, last = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps[1:]  # the role chunk and the first token come together


async def run_streams(url: str, big_body: bytes | None) -> tuple[list[float], dict | None]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = [asyncio.create_task(stream_gaps(client, 40)) for _ in range(STREAMS)]
        refusal = None
        if big_body is not None:
            await asyncio.sleep(0.5)  # the streams are running
            response = await client.post("/v1/chat/completions", content=big_body,
                                         headers={"content-type": "application/json"})
            refusal = {"status": response.status_code, **response.json()["error"]}
        return [gap for task in tasks for gap in await task], refusal


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@pytest.mark.parametrize(("context_tokens", "status", "code"), [
    (None, 413, "request_too_large"),  # 2048 tokens: no prompt needs 10 MB
    (1_000_000, 400, "context_length_exceeded"),  # tokenized off the loop, then refused
])  # fmt: skip
def test_a_10mb_prompt_does_not_stall_other_streams(
    tiny_model_path: Path, tmp_path, context_tokens: int | None, status: int, code: str
) -> None:
    model = fake_model_dir(tmp_path / "model", tiny_model_path, context_tokens)
    node = Hybrid(tmp_path, model, ["--max-request-bytes", str(32 << 20)], "http")
    try:
        node.wait_ready()
        calm, _ = asyncio.run(run_streams(node.url, None))
        text = "word " * 2_000_000
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})
        loaded, refusal = asyncio.run(run_streams(node.url, big.encode()))
    finally:
        node.stop()
    assert refusal is not None and (refusal["status"], refusal["code"]) == (status, code)
    print(f"unloaded p99 {p99(calm) * 1e3:.1f} ms, loaded max {max(loaded) * 1e3:.1f} ms")
    assert max(loaded) < 2 * p99(calm), (p99(calm), max(loaded))
