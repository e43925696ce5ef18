"""The LiteLLM provider against a real router + prefill + decode cluster (mlx, tiny checkpoint).

Every answer -- through the litellm SDK (sync, async, streaming or not) and
through the real ``litellm`` proxy queried by the ``openai`` SDK -- must carry
the same text, usage and finish reason as the cluster's own router answers
for the same greedy request.
"""

from __future__ import annotations

import os

# Offline before litellm is imported: the packaged cost map, no telemetry.
OFFLINE_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY_DISABLED": "true"}
for _name, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_name, _value)

import asyncio  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import litellm  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from mlxcel_plugin.local_cluster import LOOPBACK, LocalCluster, free_port  # noqa: E402
from router_plugin.litellm.provider import MlxcelProvider  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "litellm"
MODEL = "tiny"
MAX_TOKENS = 16
MESSAGES = [{"role": "user", "content": "Write a short story about a fox."}]
MASTER_KEY = "sk-mlxcel-test"
PROXY_START_TIMEOUT_S = 120

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str | None
    usage: tuple[int, int, int]  # prompt, completion, total


def usage_of(usage) -> tuple[int, int, int]:
    return (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


def from_response(response) -> Answer:
    choice = response.choices[0]
    return Answer(choice.message.content, choice.finish_reason, usage_of(response.usage))


def from_chunks(chunks: list) -> Answer:
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    usages = [c.usage for c in chunks if getattr(c, "usage", None) is not None]
    assert len([f for f in finishes if f]) == 1, finishes
    return Answer(text, next(f for f in finishes if f), usage_of(usages[-1]))


# -- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, tmp_path_factory) -> Iterator[LocalCluster]:
    workdir = tmp_path_factory.mktemp("litellm-cluster")
    args = ["--engine", "mlx", "--served-model-name", MODEL, "--no-warmup"]
    local = LocalCluster(workdir=workdir, model=str(tiny_model_path), common_args=args)
    local.start(180)
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def cluster_params(cluster: LocalCluster, tiny_model_path: Path) -> dict[str, str]:
    """What a model entry's ``litellm_params`` name: peers, tokenizer dir, secret."""
    return {
        "prefill_peers": ",".join(n.serving_bind for n in cluster.pool("prefill")),
        "decode_peers": ",".join(n.serving_bind for n in cluster.pool("decode")),
        "model_dir": str(tiny_model_path),
        "cluster_secret_file": str(cluster.secret_path),
    }


@pytest.fixture(scope="module")
def reference(cluster: LocalCluster) -> Answer:
    """The router's own answer over HTTP."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    r = httpx.post(f"{cluster.router.url}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    data = r.json()
    u = data["usage"]
    choice = data["choices"][0]
    answer = Answer(choice["message"]["content"], choice["finish_reason"],
                    (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]))  # fmt: skip
    assert answer.usage[1] == MAX_TOKENS and answer.finish_reason == "length"
    return answer


@pytest.fixture
def provider() -> Iterator[MlxcelProvider]:
    provider = MlxcelProvider()
    before = litellm.custom_provider_map
    litellm.custom_provider_map = [{"provider": "mlxcel", "custom_handler": provider}]
    try:
        yield provider
    finally:
        litellm.custom_provider_map = before
        provider.close()


# -- the SDK, in process ------------------------------------------------------------


def test_sdk_sync(provider, cluster_params, reference: Answer) -> None:
    kwargs = {"model": f"mlxcel/{MODEL}", "messages": MESSAGES, "max_tokens": MAX_TOKENS,
              **cluster_params}  # fmt: skip
    assert from_response(litellm.completion(**kwargs)) == reference
    stream = litellm.completion(**kwargs, stream=True, stream_options={"include_usage": True})
    assert from_chunks(list(stream)) == reference
    assert len(provider._clusters) == 1  # both calls shared the loop thread's cluster


def test_sdk_async(provider, cluster_params, reference: Answer) -> None:
    kwargs = {"model": f"mlxcel/{MODEL}", "messages": MESSAGES, "max_tokens": MAX_TOKENS,
              **cluster_params}  # fmt: skip

    async def run() -> list[Answer]:
        try:
            # Concurrent first calls: they share the one cluster being opened.
            full = await asyncio.gather(*(litellm.acompletion(**kwargs) for _ in range(2)))
            stream = await litellm.acompletion(**kwargs, stream=True,
                                               stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            assert len(provider._clusters) == 1  # one cluster for this loop, reused
            return [*map(from_response, full), from_chunks(chunks)]
        finally:
            await provider.aclose()

    assert asyncio.run(run()) == [reference] * 3


def test_sdk_errors_keep_their_status(provider, cluster_params) -> None:
    kwargs = {"model": f"mlxcel/{MODEL}", "messages": MESSAGES, **cluster_params}
    with pytest.raises(litellm.BadRequestError) as bad:
        litellm.completion(**kwargs, temperature=5)
    assert bad.value.status_code == 400 and "temperature" in str(bad.value)
    dead = {**kwargs, "prefill_peers": f"{LOOPBACK}:{free_port()}", "ready_timeout_s": 0.2}
    with pytest.raises(litellm.ServiceUnavailableError) as busy:
        litellm.completion(**dead)
    assert busy.value.status_code == 503


# -- the proxy, as a subprocess ---------------------------------------------------------


# "tiny" takes its cluster from MLXCEL_* env vars; "dead" names a prefill peer nobody serves.
PROXY_CONFIG = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: mlxcel/{model}
  - model_name: dead
    litellm_params:
      model: mlxcel/dead
      prefill_peers: [{dead_peer}]
      ready_timeout_s: 0.2
litellm_settings:
  custom_provider_map:
    - provider: mlxcel
      custom_handler: mlxcel_handler.mlxcel_provider
router_settings:
  num_retries: 0  # the proxy retries a 503 twice by default (seconds of backoff)
general_settings:
  master_key: {master_key}
"""


@dataclass
class Proxy:
    url: str
    process: subprocess.Popen
    log_path: Path
    startup_s: float

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_alive(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded by the deadline
        if process.poll() is not None:
            raise RuntimeError("the litellm proxy exited")
        try:
            if httpx.get(f"{url}/health/liveliness", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    raise TimeoutError(f"the litellm proxy did not come up in {timeout_s}s")


def start_proxy(workdir: Path, params: dict[str, str]) -> Proxy:
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLE / "mlxcel_handler.py", workdir / "mlxcel_handler.py")
    config = workdir / "config.yaml"
    dead_peer = f"{LOOPBACK}:{free_port()}"
    config.write_text(PROXY_CONFIG.format(model=MODEL, master_key=MASTER_KEY, dead_peer=dead_peer))
    cluster_env = {
        "MLXCEL_PREFILL_PEERS": params["prefill_peers"],
        "MLXCEL_DECODE_PEERS": params["decode_peers"],
        "MLXCEL_MODEL": params["model_dir"],
        "MLXCEL_CLUSTER_SECRET_FILE": params["cluster_secret_file"],
    }
    port = free_port()
    log_path = workdir / "proxy.log"
    argv = [str(Path(sys.executable).parent / "litellm"), "--config", str(config),
            "--host", LOOPBACK, "--port", str(port)]  # fmt: skip
    started = time.monotonic()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                                   env={**os.environ, **OFFLINE_ENV, **cluster_env})  # fmt: skip
    proxy = Proxy(f"http://{LOOPBACK}:{port}", process, log_path, 0.0)
    try:
        wait_alive(proxy.url, process, PROXY_START_TIMEOUT_S)
    except BaseException:
        stop(process)
        raise RuntimeError(f"proxy failed to start:\n{proxy.log_tail()}") from None
    proxy.startup_s = time.monotonic() - started
    return proxy


def stop(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)


@pytest.fixture(scope="module")
def proxy(cluster_params, tmp_path_factory) -> Iterator[Proxy]:
    proxy = start_proxy(tmp_path_factory.mktemp("litellm-proxy"), cluster_params)
    print(f"litellm proxy started in {proxy.startup_s:.1f}s")
    try:
        yield proxy
    finally:
        stop(proxy.process)


@pytest.fixture(scope="module")
def proxy_client(proxy: Proxy) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=MASTER_KEY, max_retries=0,
                       timeout=120) as client:  # fmt: skip
        yield client


def test_proxy_matches_router(proxy: Proxy, proxy_client: openai.OpenAI,
                              reference: Answer) -> None:
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    assert from_response(proxy_client.chat.completions.create(**kwargs)) == reference
    stream = proxy_client.chat.completions.create(**kwargs, stream=True,
                                                  stream_options={"include_usage": True})
    assert from_chunks(list(stream)) == reference
    assert proxy.startup_s < PROXY_START_TIMEOUT_S


def test_proxy_error_statuses(proxy_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        proxy_client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
    assert bad.value.status_code == 400
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as busy:
            proxy_client.chat.completions.create(model="dead", messages=MESSAGES, stream=stream)
        assert busy.value.status_code == 503
