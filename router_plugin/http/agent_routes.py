"""The agent APIs' routes on the front: OpenAI Responses and Anthropic Messages.

Plain Starlette routes, as the chat routes (the handlers parse their own
bodies); their models are in ``openapi_models`` for the schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.routing import Route

from router_plugin.http.messages_api.serving import MessagesServing
from router_plugin.http.responses_api.serving import ResponsesServing
from router_plugin.http.responses_api.store import ResponseStore


def install_agent_routes(app: FastAPI, front: Any, store: ResponseStore | None = None) -> None:
    """``/v1/responses`` (+ ``/{id}``), ``/v1/messages`` and ``/v1/messages/count_tokens``."""
    responses = ResponsesServing(front, store if store is not None else ResponseStore.from_env())
    messages = MessagesServing(front)
    app.state.response_store = responses.store
    app.router.routes[:0] = [
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.by_id, methods=["GET", "DELETE"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
    ]
