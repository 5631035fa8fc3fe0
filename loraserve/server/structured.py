"""A request's output constraint (OpenAI's `response_format`, vLLM's `structured_outputs`)
as the engine's StructuredOutput value."""

from __future__ import annotations

import json

from loraserve.model.structured.compiler import JSON_OBJECT_SCHEMA
from loraserve.types import StructuredOutput


def structured_output_of(req) -> StructuredOutput | None:
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutput("json", JSON_OBJECT_SCHEMA)
    if fmt is not None and fmt.type == "json_schema":
        return StructuredOutput("json", json.dumps(fmt.json_schema.schema_))
    so = req.structured_outputs
    if so is None:
        return None
    if so.json_object:
        return StructuredOutput("json", JSON_OBJECT_SCHEMA)
    if so.json_ is not None:
        spec = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
        return StructuredOutput("json", spec)
    if so.regex is not None:
        return StructuredOutput("regex", so.regex)
    if so.choice is not None:
        return StructuredOutput("choice", json.dumps(so.choice))
    return StructuredOutput("grammar", so.grammar)
