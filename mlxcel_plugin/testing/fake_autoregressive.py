"""The fake engine's autoregressive mode: each token a function of everything before it.

By default the fake engine's token at completion index ``i`` is
``next_token(prompt, i, seed)``, which a longer prompt cannot reproduce. With
``"autoregressive": true`` in ``fake_engine.json`` the factory builds an
``AutoregressiveFakeEngine``, whose token ``i`` is
``next_token(prompt + tokens 0..i-1, 0, seed)``, like a language model's: a
request whose prompt is another's prompt plus its first ``k`` tokens continues
it exactly — what a mid-stream migration relies on (docs/cluster-flow.md,
"Migration"). The first token is the same in both modes, so a prefill node of
either kind hands off to a decode node of this kind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest
from mlxcel_plugin.testing.fake_engine import FakeEngine, FakeEngineSettings
from mlxcel_plugin.testing.fake_model import CONFIG_FILE, EOS_TOKEN_ID, next_token

KNOB = "autoregressive"


def reads_autoregressive(model_dir: str | Path | None) -> bool:
    """Does ``fake_engine.json`` in ``model_dir`` ask for the autoregressive mode?"""
    path = Path(model_dir) / CONFIG_FILE if model_dir else None
    if path is None or not path.is_file():
        return False
    return bool(json.loads(path.read_text()).get(KNOB, False))


def request_seed(request: GenerationRequest) -> int | None:
    return None if request.sampling.is_greedy else request.sampling.seed


def next_autoregressive(context: list[int], request: GenerationRequest) -> int:
    """The token after ``context`` (prompt + tokens so far); appends it to ``context``."""
    token = next_token(tuple(context), 0, request_seed(request))
    context.append(token)
    return token


def autoregressive_tokens(request: GenerationRequest,
                          eos_ids: tuple[int, ...] = (EOS_TOKEN_ID,)) -> list[int]:
    """What the autoregressive fake engine emits for ``request`` (tests compare against it)."""
    context, tokens = list(request.prompt_tokens), []
    for _ in range(request.max_tokens):
        token = next_autoregressive(context, request)
        tokens.append(token)
        if token in eos_ids or token in request.stop_token_ids:
            break
    return tokens



class AutoregressiveFakeEngine(FakeEngine):
    """The fake engine whose tokens follow from the whole sequence so far."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._contexts: dict[str, list[int]] = {}  # running sequences: prompt + tokens so far

    def _token(self, request: GenerationRequest, prompt: tuple[int, ...],
               script: list[int] | None, index: int) -> tuple[int | None, str | None]:
        if script is not None or index == 0:  # the first token is the plain engine's
            return super()._token(request, prompt, script, index)
        context = self._contexts.get(request.request_id)
        if context is None:  # the first decode step, here or after a handoff
            context = self._contexts[request.request_id] = list(prompt)
            next_autoregressive(context, request)
        token = next_autoregressive(context, request)
        reason = self._finish_reason(request, token, index, False)
        if reason is not None:
            self._contexts.pop(request.request_id, None)
        return token, reason

    def _end(self, sequence: Any, reason: str) -> None:
        self._contexts.pop(sequence.request.request_id, None)
        super()._end(sequence, reason)


def engine_class(model_dir: str | Path | None) -> type[FakeEngine]:
    """The engine ``fake_engine.json`` in ``model_dir`` asks for."""
    return AutoregressiveFakeEngine if reads_autoregressive(model_dir) else FakeEngine


def make_fake_engine(model_path: str | None, config: EngineConfig) -> FakeEngine:
    """The ``fake`` engine factory: mode and knobs from ``fake_engine.json`` in ``model_path``."""
    return engine_class(model_path)(FakeEngineSettings.from_dir(model_path), config)
