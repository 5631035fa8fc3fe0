"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right
status; `param` names the request field at fault, when one is.

Anything the client did wrong is a 4xx with a message that says what to fix; a 5xx is a bug
(its traceback goes to the log, not to the client). Every 503 (a passing condition: shutting
down, busy, a replica gone) carries Retry-After.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraserve.types import LoraServeError

log = logging.getLogger("loraserve.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}


RETRY_AFTER_S = 5  # a 503 that names no better time


def retry_headers(status: int, retry_after_s: int | None = None) -> dict[str, str]:
    """Retry-After for a 503 (or for any status given a time), else nothing."""
    if retry_after_s is None and status == 503:
        retry_after_s = RETRY_AFTER_S
    return {} if retry_after_s is None else {"retry-after": str(retry_after_s)}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 retry_after_s: int | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.retry_after_s, self.param = retry_after_s, param


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status,
                        headers=retry_headers(status))


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, code)).encode()


def validation_error(err: ValidationError | RequestValidationError) -> ApiError:
    """A 400 that says what to fix in the client's words: each error's field path and message
    (without pydantic's "Value error, " prefixes), `param` the first error's field."""
    parts, params = [], []
    for e in err.errors():
        loc = [x for x in e.get("loc", ()) if x != "body"]
        ctx = e.get("ctx") or {}
        path = ".".join(map(str, loc))
        param = ctx.get("param")
        if param and loc and param != loc[-1]:  # a field of a nested object
            param = f"{path}.{param}"
        elif not param and loc:  # pydantic's own: the top-level field (no union-member tags)
            param = str(loc[0])
        params.append(param)
        # a plain ValueError/AssertionError from a validator: its own text, no prefix
        msg = str(ctx["error"]) if e.get("type") in _WRAPPED and "error" in ctx else e["msg"]
        if loc and not msg.startswith(f"{loc[0]}:"):
            msg = f"{path}: {msg}"
        parts.append(msg)
    return ApiError(400, "invalid request: " + "; ".join(parts[:5]), "invalid_request",
                    param=next((p for p in params if p), None))


_WRAPPED = ("value_error", "assertion_error")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError):
        response = error_response(e.status, e.message, e.code, e.param)
        response.headers.update(retry_headers(e.status, e.retry_after_s))
        return response

    @app.exception_handler(LoraServeError)
    async def _engine(_: Request, e: LoraServeError):
        response = error_response(e.status, str(e), e.code)
        response.headers.update(retry_headers(e.status, getattr(e, "retry_after_s", None)))
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        err = validation_error(e)
        return error_response(err.status, err.message, err.code, err.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), None)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal server error ({type(e).__name__})", "internal")
