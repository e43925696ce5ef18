"""The engine contract for delta handoffs (``reserve_prefix`` / ``release_prefix``).

Part of ``EngineContract``. Both methods are optional (``engine_api.Engine``):
an engine without them, or without a prefix cache, holds no prefix and every
handoff to it is whole. An engine that offers them must refuse a prefix it
does not hold, continue a handed-off stream token for token from a delta
spliced onto a prefix it reserved, and fail only that request when a delta
comes after its pin was released.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mlxcel_plugin.engine_api import (
    FINISH_ERROR,
    Engine,
    GenerationRequest,
    release_prefix,
    reserve_prefix,
)
from mlxcel_plugin.testing.engine_harness import (
    PROMPT_TOKENS,
    EventLog,
    check_natural_end,
    check_stream,
    generate,
    make_prompt,
    make_request,
    prefill,
    through_the_wire,
    wait_idle,
)

NEW_TOKENS = 20  # what a later request adds after the shared part


def _reservable(engine: Engine, request_id: str, prompt: tuple[int, ...]) -> int:
    """The longest prefix of ``prompt`` the engine can pin (pinned now), or 0."""
    for prefix in range(len(prompt) - 1, 0, -1):
        if reserve_prefix(engine, request_id, prompt, prefix):
            return prefix
    return 0


def _handed_off_then_shared(prefill_engine: Engine, decode_engine: Engine,
                            name: str) -> GenerationRequest:
    """Hand one prompt off whole (the decode engine may keep it); a request sharing it."""
    info = prefill_engine.info
    first = make_request(info, f"{name}-first", 2)
    result, _ = prefill(prefill_engine, first)
    log = EventLog()
    decode_engine.decode(first, result.first_token, through_the_wire(result, info,
                                                                      decode_engine), log)
    check_stream(log.wait(), 1, first.max_tokens)
    fresh = make_prompt(info, NEW_TOKENS, seed=PROMPT_TOKENS + 1)
    return GenerationRequest(name, first.prompt_tokens[:PROMPT_TOKENS - 3] + fresh, 10)


class DeltaHandoffContract:
    def test_a_prefix_never_seen_cannot_be_reserved(self, engine):
        prompt = make_prompt(engine.info, PROMPT_TOKENS, seed=901)
        assert reserve_prefix(engine, "never-seen", prompt, PROMPT_TOKENS - 1) is False
        release_prefix(engine, "never-seen")  # harmless without a pin
        assert reserve_prefix(engine, "whole", prompt, len(prompt)) is False  # nothing left

    def test_a_delta_on_a_reserved_prefix_continues_the_stream(
            self, started: Callable[[], Engine]):
        prefill_engine, decode_engine = started(), started()
        request = _handed_off_then_shared(prefill_engine, decode_engine, "delta")
        prefix = _reservable(decode_engine, request.request_id, request.prompt_tokens)
        if not prefix:
            pytest.skip("the engine keeps no prefix of a handed-off prompt")
        single_node = generate(prefill_engine, request)
        result, _ = prefill(prefill_engine, request)
        cache = through_the_wire(result, prefill_engine.info, decode_engine, prefix)
        log = EventLog()
        decode_engine.decode(request, result.first_token, cache, log)
        check_stream(log.wait(), 1, request.max_tokens)
        check_natural_end(log, prefill_engine.info, request)
        assert [result.first_token, *log.tokens] == single_node.tokens
        wait_idle(decode_engine)

    def test_a_delta_after_its_pin_was_released_fails_alone(self, started):
        prefill_engine, decode_engine = started(), started()
        request = _handed_off_then_shared(prefill_engine, decode_engine, "released")
        prefix = _reservable(decode_engine, request.request_id, request.prompt_tokens)
        if not prefix:
            pytest.skip("the engine keeps no prefix of a handed-off prompt")
        release_prefix(decode_engine, request.request_id)
        result, _ = prefill(prefill_engine, request)
        cache = through_the_wire(result, prefill_engine.info, decode_engine, prefix)
        log = EventLog()
        decode_engine.decode(request, result.first_token, cache, log)
        log.wait()
        assert len(log.events) == 1, f"one error event, got {log.events[:3]}"
        assert (log.terminal.index, log.terminal.finish_reason) == (1, FINISH_ERROR)
        wait_idle(decode_engine)
