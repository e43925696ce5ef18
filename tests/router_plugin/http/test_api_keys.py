"""``--api-key``: Bearer keys on the API, OpenAI's 401, probes open unless asked."""

from __future__ import annotations

import httpx
import pytest

from mlxcel_plugin.config import build_config
from mlxcel_plugin.errors import ConfigError
from router_plugin.http.api_keys import ApiKeys, needs_key
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app
from router_plugin.http.options import FrontOptions

MODEL = "tiny"
USER = [{"role": "user", "content": "Say hi"}]
KEYS = frozenset({"sk-one", "sk-two"})

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def client_with(tokenizer, engine, **options) -> httpx.AsyncClient:
    app = make_app(LocalEngineBackend(engine), tokenizer, MODEL,
                   options=FrontOptions(api_keys=KEYS, **options))  # fmt: skip
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_api_needs_a_key(text_tokenizer, make_engine) -> None:
    ids = text_tokenizer.encode("fine", add_special_tokens=False) + [2]
    engine = make_engine(lambda request: ids)
    client = client_with(text_tokenizer, engine)
    body = {"messages": USER}
    for headers in ({}, bearer("sk-three"), bearer("sk-one-"), {"Authorization": "sk-one"},
                    {"Authorization": "Basic sk-one"}):  # fmt: skip
        refused = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.json()["error"]["type"] == "invalid_request_error"
        assert refused.headers["www-authenticate"] == "Bearer"
    assert (await client.get("/v1/models")).status_code == 401
    assert (await client.get("/v1/nowhere")).status_code == 401  # nothing leaks past the gate
    assert not engine.requests
    for key in KEYS:
        ok = await client.post("/v1/chat/completions", json=body, headers=bearer(key))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"
    lower = await client.get("/v1/models", headers={"authorization": "bearer sk-two"})
    assert lower.status_code == 200
    # Probes, scrapers and the schema stay open; refusals are counted.
    for path in ("/health", "/metrics", "/openapi.json", "/docs"):
        assert (await client.get(path)).status_code == 200, path
    metrics = (await client.get("/metrics")).text
    assert 'code="invalid_api_key",model_name="tiny",status="401"} 7.0' in metrics


async def test_metrics_require_key(text_tokenizer, make_engine) -> None:
    client = client_with(text_tokenizer, make_engine(lambda r: [2]), metrics_require_key=True)
    for path in ("/health", "/metrics", "/health/ready"):
        assert (await client.get(path)).status_code == 401, path
    assert (await client.get("/metrics", headers=bearer("sk-one"))).status_code == 200


async def test_no_keys_means_open(text_tokenizer, make_engine) -> None:
    app = make_app(LocalEngineBackend(make_engine(lambda r: [2])), text_tokenizer, MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        assert (await c.get("/v1/models")).status_code == 200


def test_key_matching() -> None:
    keys = ApiKeys(["sk-a"])
    assert keys.accepts(b"Bearer sk-a") and keys.accepts(b"bearer  sk-a ")
    assert not any(keys.accepts(v) for v in (None, b"", b"Bearer ", b"Bearer sk-", b"sk-a"))
    assert not ApiKeys([]) and ApiKeys(["x"])
    assert needs_key("/v1/models", ops_require_key=False)
    assert needs_key("/router/stats", ops_require_key=False)
    assert not needs_key("/health/live", ops_require_key=False)
    assert needs_key("/metrics", ops_require_key=True)


def test_keys_from_flags_and_env() -> None:
    assert build_config({"api_keys": ["a", "b"]}, {}).api_keys == {"a", "b"}
    assert build_config({}, {"MLXCEL_API_KEY": "x, y,"}).api_keys == {"x", "y"}
    assert "sk-secret" not in repr(build_config({}, {"MLXCEL_API_KEY": "sk-secret"}))
    with pytest.raises(ConfigError):
        FrontOptions(api_keys=frozenset({" padded"}))
    with pytest.raises(ConfigError):
        build_config({"ssl_keyfile": "/nonexistent.key"}, {})
