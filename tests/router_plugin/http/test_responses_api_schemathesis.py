"""schemathesis over the agent APIs' operations in ``/openapi.json`` (Responses, Messages).

No 5xx, answers (bodies, errors, status codes) as the schema publishes them,
and what the schema refuses is refused. Bounded examples per operation.
``positive_data_acceptance`` is left out as in ``test_front_schemathesis.py``:
the schema cannot say all the parser refuses (a tool result for an unknown
call id, a prompt over the context).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from mlxcel_plugin.testing.fake_engine import FakeEngine
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app

MODEL = "tiny"
AGENT_PATHS = {"/v1/responses", "/v1/responses/{response_id}", "/v1/messages",
               "/v1/messages/count_tokens"}  # fmt: skip


@pytest.fixture(scope="module")
def front_app(text_tokenizer) -> Iterator:
    ids = text_tokenizer.encode("fine", add_special_tokens=False) + [2]
    engine = FakeEngine.scripted(lambda request: ids)
    engine.start()
    yield make_app(LocalEngineBackend(engine), text_tokenizer, MODEL)
    engine.close()


def test_agent_apis_conform_to_their_schema(front_app) -> None:
    loaded = schemathesis.openapi.from_asgi("/openapi.json", front_app)
    ops = [result.ok() for result in loaded.get_all_operations()]
    ops = [op for op in ops if op.path in AGENT_PATHS]
    assert {op.path for op in ops} == AGENT_PATHS and len(ops) == 5
    # A path id has no negative form: only the POST bodies get negative examples too.
    runs = [(op, mode) for op, mode in itertools.product(ops, GenerationMode)
            if mode == GenerationMode.POSITIVE or op.method.upper() == "POST"]
    for op, mode in runs:

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def conforms(case) -> None:
            case.call_and_validate(excluded_checks=[positive_data_acceptance])

        conforms()
