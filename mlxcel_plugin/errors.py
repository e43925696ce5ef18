"""One exception hierarchy for the whole project.

Every error that can reach an HTTP client maps to an OpenAI-shaped body
(``{"error": {"message", "type", "param", "code"}}``) through ``to_openai``.
"""

from __future__ import annotations

from typing import Any


class MlxcelError(Exception):
    """Base of every error the project raises on purpose."""

    status_code = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class ConfigError(MlxcelError):
    """Bad configuration at startup (one-line message on the CLI)."""

    code = "config_error"


class PluginError(ConfigError):
    """A plugin failed to load, or a configured name is not registered."""

    code = "plugin_error"


class InvalidRequestError(MlxcelError):
    """The client sent something we cannot serve (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class ModelNotFoundError(InvalidRequestError):
    status_code = 404
    code = "model_not_found"


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class RequestTooLargeError(InvalidRequestError):
    """The body is over ``--max-request-bytes``."""

    status_code = 413
    code = "request_too_large"


class UnsupportedMediaTypeError(InvalidRequestError):
    status_code = 415
    code = "unsupported_media_type"


class AuthenticationError(InvalidRequestError):
    """No or a wrong ``Authorization: Bearer`` key (``--api-key``); OpenAI's 401."""

    status_code = 401
    code = "invalid_api_key"


class AtCapacityError(MlxcelError):
    """Every node is busy; the client should retry after ``retry_after_s``."""

    status_code = 503
    error_type = "server_error"
    code = "at_capacity"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.retry_after_s = retry_after_s


class NoHealthyNodeError(AtCapacityError):
    code = "no_healthy_node"


class NodeDrainingError(AtCapacityError):
    """The node got SIGTERM: it finishes its work but takes none.

    Sent as an ERROR frame without ``request_id`` on each router link (the node
    is draining); a REQUEST it refuses meanwhile gets plain ``at_capacity``, so
    any router re-places it (docs/cluster-flow.md, "Failure detection and drain").
    """

    code = "node_draining"


class ProtocolError(MlxcelError):
    """A peer broke the link protocol (bad record, frame, handshake)."""

    code = "protocol_error"


class HandshakeError(ProtocolError):
    code = "handshake_failed"


class ModelMismatchError(HandshakeError):
    """The node announced another model than the router's checkpoint."""

    code = "model_mismatch"


class HandoffError(MlxcelError):
    """A KV handoff was refused or failed; fails only that request."""

    code = "handoff_failed"


class CacheNotTransferableError(HandoffError):
    """The model keeps a cache class with no handoff form: it cannot run disaggregated.

    Refused per request before any compute, naming the class; hybrid serving works.
    """

    status_code = 501
    error_type = "not_implemented_error"
    code = "cache_not_transferable"


class EngineError(MlxcelError):
    """The engine failed while serving one request."""

    code = "engine_error"


class NodeLostError(MlxcelError):
    """A node serving this request went away mid-stream."""

    status_code = 502
    code = "node_lost"
