"""What every route handler needs: the async engine, the settings, metrics, model names."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from loraserve.adapters.versions import split_model
from loraserve.engine.async_engine import AsyncEngine
from loraserve.server.api_keys import KeyRing, Tenant
from loraserve.server.errors import ApiError, validation_error
from loraserve.server.metrics import ServerMetrics
from loraserve.server.quotas import QuotaGate
from loraserve.server.settings import ServerSettings
from loraserve.types import is_valid_adapter_name

M = TypeVar("M", bound=BaseModel)
MAX_JSON_DEPTH = 32  # OpenAI requests nest 5-6 levels (content parts, tool schemas)


@dataclass
class ServerContext:
    aengine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)

    draining: bool = False  # shutting down: no new requests, in-flight ones may finish
    in_flight: int = 0  # HTTP requests being answered (drain.py counts them)

    def check_accepting(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica or "
                                "later", "server_unavailable", retry_after_s=5)

    def begin_drain(self, timeout_s: float) -> None:
        """Stop admitting; after `timeout_s` end whatever still runs with a 503 error
        (event loop thread)."""
        if self.draining:
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        loop.call_later(
            timeout_s, self.aengine.abort_all,
            f"the server shut down before this request finished ({timeout_s:g} s drain)")
        loop.call_later(timeout_s, self.aengine.cancel_loads)

    def __post_init__(self) -> None:
        s = self.settings
        self.keys = KeyRing(s.api_keys_file, reserved=(s.api_key, s.admin_api_key))
        self.quotas = QuotaGate()
        info = self.aengine.info
        self.model_name: str = info.model_name
        self.model_path: str = info.model_path
        names = {self.model_name, *self.settings.served_model_names, info.model_path,
                 Path(info.model_path).name}
        self.base_names = frozenset(n for n in names if n)

    @property
    def tokenizer(self):
        return self.aengine.tokenizer

    def resolve_model(self, model: str | None, tenant: Tenant | None = None) -> str | None:
        """`model` -> adapter name, or None for the base model. Unknown names, and names
        outside the tenant's scope (it cannot tell them from unknown ones): 404."""
        name = self._resolve(model)
        if tenant is not None and not tenant.may_use(
                None if name is None else split_model(name)[0]):  # name@N: name's scope
            raise self.model_not_found(model or self.model_name)
        return name

    def _resolve(self, model: str | None) -> str | None:
        if model is None or model in self.base_names:
            return None
        name = model
        base, sep, adapter = model.partition(":")
        if sep:
            if base not in self.base_names:
                raise self.model_not_found(model)
            name = adapter
        if not is_valid_adapter_name(split_model(name)[0]):  # name or name@N
            raise self.model_not_found(model)
        return name

    def model_not_found(self, model: str) -> ApiError:
        return ApiError(404, f"The model {model!r} does not exist: use the base model "
                             f"{self.model_name!r}, a loaded adapter's name or "
                             f"'{self.model_name}:ADAPTER' (GET /v1/models lists them)",
                        "model_not_found")

    async def run_blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def check_json_values(data: object) -> None:
    """Refuse what JSON can carry but nothing downstream should see: nesting deeper than
    MAX_JSON_DEPTH, and strings that are not valid Unicode (lone surrogates from \\ud800
    escapes, which no tokenizer or file system accepts)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                           "invalid_json")
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k)
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"a string in the request is not valid Unicode ({e.reason} at "
                            f"position {e.start})", "invalid_json") from e


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated into `model`; malformed or invalid input is a 400."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except RecursionError as e:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                       "invalid_json") from e
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of over 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_json") from e
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_request")
    check_json_values(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e
