"""OpenAI-shaped error responses for everything the front answers with a 4xx/5xx.

``{"error": {"message", "type", "param", "code"}}``, including the framework's
own 404/405/422 (a 405 keeps its ``Allow`` header). Refusals the framework
makes (no route, wrong method) are counted here; the front counts its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxcel_plugin.errors import AtCapacityError, InvalidRequestError, MlxcelError

logger = logging.getLogger("router_plugin.http.front")

# Called with (status, code) for each refusal counted here.
Refused = Callable[[int, str], None]


def error_response(exc: MlxcelError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    extra = dict(headers or {})
    if isinstance(exc, AtCapacityError):
        extra["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return JSONResponse(exc.to_openai(), status_code=exc.status_code, headers=extra)


def http_error(status: int, message: str, code: str,
               headers: Mapping[str, str] | None = None) -> JSONResponse:  # fmt: skip
    error_type = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def _ignore(status: int, code: str) -> None:
    return None


def install_error_handlers(app: FastAPI, refused: Refused = _ignore) -> None:
    """Every error a client sees is OpenAI-shaped, including framework 404/405/422."""

    async def on_mlxcel(_: Request, exc: MlxcelError) -> JSONResponse:
        return error_response(exc)

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        refused(exc.status_code, code)
        return http_error(exc.status_code, str(exc.detail), code, exc.headers)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        refused(422, "validation_error")
        return http_error(422, f"invalid request: {exc.errors()}", "validation_error")

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request", exc_info=exc)
        refused(500, "internal_error")
        return http_error(500, "internal server error", "internal_error")

    async def on_recursion(_: Request, exc: RecursionError) -> JSONResponse:
        # Deeply nested JSON escaping the parser's own check (a validator, a template).
        error = InvalidRequestError("the request is nested too deeply")
        refused(error.status_code, str(error.code))
        return error_response(error)

    app.add_exception_handler(MlxcelError, on_mlxcel)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(RecursionError, on_recursion)
    app.add_exception_handler(Exception, on_unexpected)
