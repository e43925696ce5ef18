"""schemathesis over ``/openapi.json``: no 5xx, answers match the published schema.

Bounded examples per operation so it runs in seconds. ``positive_data_acceptance``
is left out on purpose: the schema cannot say everything the parser refuses
(a prompt over the context, ``stream_options`` without ``stream``), and those
refusals are correct 400s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

from mlxcel_plugin.testing.fake_engine import FakeEngine
from router_plugin.http.backend import LocalEngineBackend
from router_plugin.http.front import make_app

MODEL = "tiny"


@pytest.fixture(scope="module")
def front_app(text_tokenizer) -> Iterator:
    ids = text_tokenizer.encode("fine", add_special_tokens=False) + [2]
    engine = FakeEngine.scripted(lambda request: ids)
    engine.start()
    yield make_app(LocalEngineBackend(engine), text_tokenizer, MODEL)
    engine.close()


def operations(app) -> list:
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app)
    return [result.ok() for result in loaded.get_all_operations()]


def test_api_conforms_to_its_schema(front_app) -> None:
    ops = operations(front_app)
    paths = {op.path for op in ops}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= paths
    for op in ops:

        @given(case=op.as_strategy())
        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def conforms(case) -> None:
            case.call_and_validate(excluded_checks=[positive_data_acceptance])

        conforms()
