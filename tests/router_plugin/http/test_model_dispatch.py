"""The several-model front: requests reach their model's app, unknown models get 404,
``/v1/models`` and ``/metrics`` cover every model, the API key still guards (no sockets)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router_plugin.http.adapters_api import install_adapter_routes
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app
from router_plugin.http.merged_metrics import merge_expositions
from router_plugin.http.model_dispatch import ModelDispatcher
from router_plugin.http.options import FrontOptions

EOS = 2
USER = [{"role": "user", "content": "Say hi"}]
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _dispatcher(text_tokenizer: Any, make_engine: Any, **options: Any) -> ModelDispatcher:
    apps = {}
    for name, text in (("alpha", "from alpha"), ("beta", "from beta")):
        ids = text_tokenizer.encode(text, add_special_tokens=False) + [EOS]
        engine = make_engine(lambda request, ids=ids: ids)
        apps[name] = make_app(LocalEngineBackend(engine), text_tokenizer, name,
                              options=FrontOptions(**options))  # fmt: skip
    return ModelDispatcher(apps, max_request_bytes=1 << 20)


def _client(app: Any, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t",
                             headers=headers)  # fmt: skip


async def _chat(client: httpx.AsyncClient, model: str | None) -> httpx.Response:
    body: dict[str, Any] = {"messages": USER, "max_tokens": 8}
    if model is not None:
        body["model"] = model
    return await client.post("/v1/chat/completions", json=body)


async def test_each_model_is_served_by_its_own_app(text_tokenizer, make_engine) -> None:
    async with _client(_dispatcher(text_tokenizer, make_engine)) as client:
        for name in ("alpha", "beta"):
            reply = (await _chat(client, name)).json()
            assert reply["model"] == name
            assert reply["choices"][0]["message"]["content"] == f"from {name}"
        default = (await _chat(client, None)).json()
        assert default["model"] == "alpha"  # no model: the first one
        completion = await client.post(
            "/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 4}
        )
        assert completion.json()["choices"][0]["text"] == "from beta"


async def test_unknown_model_is_404_model_not_found(text_tokenizer, make_engine) -> None:
    async with _client(_dispatcher(text_tokenizer, make_engine)) as client:
        refused = await _chat(client, "gamma")
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "model_not_found"


async def test_an_adapter_goes_to_the_pool_of_its_base(text_tokenizer, make_engine) -> None:
    dispatcher = _dispatcher(text_tokenizer, make_engine)
    dispatcher.apps["beta"].state.front.adapters = {"beta-lora": "beta"}
    async with _client(dispatcher) as client:
        reply = (await _chat(client, "beta-lora")).json()
        cards = (await client.get("/v1/models")).json()["data"]
    assert reply["model"] == "beta-lora"
    assert reply["choices"][0]["message"]["content"] == "from beta"
    assert {"id": "beta-lora", "parent": "beta"}.items() <= cards[-1].items()


class PoolAdapters:
    """A pool's adapter manager: what it loaded, as its nodes' announcements would show."""

    def __init__(self, front: Any, base: str):
        self.front, self.base, self.calls = front, base, []

    async def load(self, name: str, path: str) -> dict[str, Any]:
        self.calls.append(("load", name))
        self.front.adapters[name] = self.base
        return {"digest": "d"}

    async def unload(self, name: str) -> dict[str, Any]:
        self.calls.append(("unload", name))
        self.front.adapters.pop(name)
        return {"nodes": ["n"]}


def _with_adapter_routes(dispatcher: ModelDispatcher) -> tuple[ModelDispatcher, dict]:
    """The same pools with load/unload routes, under a dispatcher that knows them."""
    managers = {}
    for name, app in dispatcher.apps.items():
        managers[name] = PoolAdapters(app.state.front, name)
        install_adapter_routes(app, None, name, managers[name])
    return ModelDispatcher(dispatcher.apps, max_request_bytes=1 << 20), managers


async def test_load_and_unload_reach_the_pool_of_the_base(text_tokenizer, make_engine) -> None:
    dispatcher, managers = _with_adapter_routes(_dispatcher(text_tokenizer, make_engine))
    async with _client(dispatcher) as client:
        loaded = await client.post("/v1/load_lora_adapter", json={
            "lora_name": "sql", "lora_path": "/a", "base_model_name": "beta"})  # fmt: skip
        reply = (await _chat(client, "sql")).json()
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        gone = await _chat(client, "sql")
    assert loaded.json()["status"] == "loaded"
    assert reply["choices"][0]["message"]["content"] == "from beta"
    assert unloaded.json()["nodes"] == ["n"]
    assert managers["beta"].calls == [("load", "sql"), ("unload", "sql")]
    assert managers["alpha"].calls == []
    assert gone.status_code == 404


async def test_adapter_names_stay_unique_across_pools(text_tokenizer, make_engine) -> None:
    dispatcher, managers = _with_adapter_routes(
        _dispatcher(text_tokenizer, make_engine, api_keys=frozenset({"k"}))
    )
    dispatcher.apps["alpha"].state.front.adapters["taken"] = "alpha"
    bodies = {  # body -> (status, the error's param or code)
        ("alpha", "beta"): (400, "lora_name"),  # another model's name
        ("taken", "beta"): (400, "lora_name"),  # another pool's adapter
        ("new", "gamma"): (404, "model_not_found"),  # no such base
    }
    async with _client(dispatcher) as client:
        guarded = await client.post("/v1/load_lora_adapter", json={
            "lora_name": "new", "lora_path": "/a", "base_model_name": "gamma"})  # fmt: skip
    async with _client(dispatcher, authorization="Bearer k") as client:
        for (name, base), (status, what) in bodies.items():
            refused = await client.post("/v1/load_lora_adapter", json={
                "lora_name": name, "lora_path": "/a", "base_model_name": base})  # fmt: skip
            error = refused.json()["error"]
            assert (refused.status_code, what) == (status, error["param"] if status == 400
                                                   else error["code"]), name  # fmt: skip
    assert guarded.status_code == 401  # the key first: nothing learnt about which bases exist
    assert managers["alpha"].calls == managers["beta"].calls == []


async def test_models_and_metrics_cover_every_model(text_tokenizer, make_engine) -> None:
    async with _client(_dispatcher(text_tokenizer, make_engine)) as client:
        await _chat(client, "alpha")
        await _chat(client, "beta")
        cards = (await client.get("/v1/models")).json()["data"]
        metrics = (await client.get("/metrics")).text
    assert [card["id"] for card in cards] == ["alpha", "beta"]
    assert all(card["max_model_len"] == text_tokenizer.context_length for card in cards)
    assert metrics.count("# TYPE mlxcel:generation_tokens_total counter") == 1
    assert 'mlxcel:generation_tokens_total{model_name="beta"}' in metrics
    assert 'mlxcel:generation_tokens_total{model_name="alpha"}' in metrics


async def test_the_api_key_guards_every_model(text_tokenizer, make_engine) -> None:
    dispatcher = _dispatcher(text_tokenizer, make_engine, api_keys=frozenset({"k"}))
    async with _client(dispatcher) as client:
        assert (await _chat(client, "beta")).status_code == 401
        assert (await _chat(client, "gamma")).status_code == 401  # no model list leaks
        assert (await client.get("/v1/models")).status_code == 401
    async with _client(dispatcher, authorization="Bearer k") as client:
        assert (await _chat(client, "beta")).status_code == 200
        assert len((await client.get("/v1/models")).json()["data"]) == 2


def test_samples_without_a_model_label_get_their_models() -> None:
    text, _ = merge_expositions({
        "a": b"# HELP up Up.\n# TYPE up gauge\nup 1.0\n",
        "b": b"# HELP up Up.\n# TYPE up gauge\nup 0.0\n",
    })  # fmt: skip
    assert text.decode().splitlines() == [
        "# HELP up Up.", "# TYPE up gauge", 'up{model_name="a"} 1.0', 'up{model_name="b"} 0.0',
    ]  # fmt: skip
