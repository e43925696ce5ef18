"""The LiteLLM provider over a fake engine, through the real litellm SDK (no sockets).

What the cluster test cannot show with a random-weight model: reasoning
split into ``reasoning_content``, and the error statuses of each entry point.
"""

from __future__ import annotations

import asyncio
import os
import time

# Offline before litellm is imported: the packaged cost map, no telemetry.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY_DISABLED", "true")

from collections.abc import Callable, Iterator  # noqa: E402
from typing import Any  # noqa: E402

import litellm  # noqa: E402
import pytest  # noqa: E402

from mlxcel_plugin.errors import ConfigError  # noqa: E402
from router_plugin.http.backend import LocalEngineBackend  # noqa: E402
from router_plugin.http.front import OpenAIFront  # noqa: E402
from router_plugin.http.metrics import FrontMetrics  # noqa: E402
from router_plugin.litellm.provider import (  # noqa: E402
    Cluster,
    ClusterSettings,
    MlxcelProvider,
    check_peers,
    request_body,
)
from tests.router_plugin.http.test_front import ScriptedBackend, reply  # noqa: E402

MODEL = "mlxcel/tiny"
USER = [{"role": "user", "content": "Say hi"}]
PEERS = {"prefill_peers": "127.0.0.1:1", "decode_peers": "127.0.0.1:2"}


class FixedClusterProvider(MlxcelProvider):
    """The provider with its cluster replaced by a local backend."""

    def __init__(self, front: OpenAIFront):
        super().__init__(env={})
        self.front = front

    async def cluster(self, settings: ClusterSettings) -> Cluster:
        return Cluster(self.front.backend, self.front)  # type: ignore[arg-type]


@pytest.fixture
def use_provider(text_tokenizer) -> Iterator[Callable[[Any], MlxcelProvider]]:
    """Register a provider over ``backend`` as LiteLLM's ``mlxcel``."""
    before = litellm.custom_provider_map
    providers: list[MlxcelProvider] = []

    def use(backend: Any) -> MlxcelProvider:
        front = OpenAIFront(backend, text_tokenizer, "tiny", context_length=None,
                            system_fingerprint=None, metrics=FrontMetrics("tiny"))  # fmt: skip
        providers.append(FixedClusterProvider(front))
        litellm.custom_provider_map = [{"provider": "mlxcel", "custom_handler": providers[-1]}]
        return providers[-1]

    yield use
    litellm.custom_provider_map = before
    for provider in providers:
        provider.close()


@pytest.fixture
def scripted(use_provider, text_tokenizer, make_engine) -> Callable[[str], MlxcelProvider]:
    """A provider whose every request is answered with ``text`` (then EOS)."""

    def make(text: str) -> MlxcelProvider:
        return use_provider(LocalEngineBackend(make_engine(reply(text_tokenizer, text))))

    return make


def reasoning_and_text(chunks: list) -> tuple[str, str]:
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return reasoning, "".join(d.content or "" for d in deltas)


def test_reasoning_content_in_every_entry_point(scripted) -> None:
    scripted("<think>2+2 is 4.</think>The answer is 4.")
    full = litellm.completion(model=MODEL, messages=USER)
    message = full.choices[0].message
    assert (message.reasoning_content, message.content) == ("2+2 is 4.", "The answer is 4.")
    assert full.choices[0].finish_reason == "stop" and full.usage.completion_tokens > 0
    chunks = list(litellm.completion(model=MODEL, messages=USER, stream=True,
                                     stream_options={"include_usage": True}))  # fmt: skip
    assert reasoning_and_text(chunks) == ("2+2 is 4.", "The answer is 4.")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    async def run() -> list:
        stream = await litellm.acompletion(model=MODEL, messages=USER, stream=True)
        return [chunk async for chunk in stream]

    assert reasoning_and_text(asyncio.run(run())) == ("2+2 is 4.", "The answer is 4.")


def test_first_stream_delta_names_the_role(scripted) -> None:
    scripted("Hello")
    chunks = list(litellm.completion(model=MODEL, messages=USER, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"


def test_refusal_is_503_in_every_entry_point(use_provider) -> None:
    use_provider(ScriptedBackend(refuse=True))
    with pytest.raises(litellm.ServiceUnavailableError) as busy:
        litellm.completion(model=MODEL, messages=USER)
    assert busy.value.status_code == 503
    with pytest.raises(litellm.ServiceUnavailableError) as busy:
        list(litellm.completion(model=MODEL, messages=USER, stream=True))
    assert busy.value.status_code == 503

    async def refused() -> None:
        await litellm.acompletion(model=MODEL, messages=USER)

    with pytest.raises(litellm.ServiceUnavailableError):
        asyncio.run(refused())


def test_invalid_request_is_400_and_context_overflow_is_context_error(scripted) -> None:
    scripted("x")
    with pytest.raises(litellm.BadRequestError) as bad:
        litellm.completion(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert bad.value.status_code == 400
    huge = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=MODEL, messages=huge)


def test_settings_from_litellm_params() -> None:
    settings = ClusterSettings.from_params(
        {**PEERS, "custom_llm_provider": "mlxcel"},
        {"decode_peers": ["127.0.0.1:3", "127.0.0.1:4"], "model_dir": None,
         "ready_timeout_s": 2, "temperature": 0.5},
    )  # fmt: skip
    assert dict(settings.flags) == {"prefill_peers": "127.0.0.1:1",
                                    "decode_peers": ("127.0.0.1:3", "127.0.0.1:4")}  # fmt: skip
    assert settings.ready_timeout_s == 2.0
    assert hash(settings) == hash(ClusterSettings.from_params(dict(settings.flags),
                                                              {"ready_timeout_s": 2}))  # fmt: skip


def test_request_body_drops_cluster_settings() -> None:
    params = {**PEERS, "max_tokens": 5, "stop": None, "extra_body": {"top_k": 3}}
    assert request_body(USER, params, stream=True) == {
        "max_tokens": 5, "top_k": 3, "messages": USER, "stream": True,
    }  # fmt: skip


def test_missing_peers_name_the_setting(tiny_model_path) -> None:
    settings = ClusterSettings.from_params({"model_dir": str(tiny_model_path)})
    with pytest.raises(ConfigError, match="prefill_peers in litellm_params or MLXCEL_PREFILL"):
        check_peers(dict(settings.flags), {})
    check_peers(dict(settings.flags), {"MLXCEL_PREFILL_PEERS": "a:1", "MLXCEL_DECODE_PEERS": "b:2"})


def test_closing_the_stream_cancels_the_request(use_provider, text_tokenizer,
                                                make_engine) -> None:
    engine = make_engine(reply(text_tokenizer, "word " * 200), token_delay_s=0.01)
    use_provider(LocalEngineBackend(engine))
    stream = litellm.completion(model=MODEL, messages=USER, stream=True)
    next(iter(stream))
    stream.close()  # the sync path: closed on the provider's loop thread

    async def read_one_then_close() -> None:
        stream = await litellm.acompletion(model=MODEL, messages=USER, stream=True)
        await anext(aiter(stream))
        await stream.aclose()

    asyncio.run(read_one_then_close())
    deadline = time.monotonic() + 5
    while len(engine.cancelled) < 2 and time.monotonic() < deadline:  # the engine thread's pace
        time.sleep(0.01)
    assert len(engine.cancelled) == 2
