"""Mistral calls: [TOOL_CALLS] (a special token, absent from the text) then a JSON array

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

Mistral's templates require 9-character alphanumeric call ids."""

from __future__ import annotations

import json
import secrets

from loraserve.model.tools.base import (
    ALNUM,
    ParsedOutput,
    Tool,
    ToolFormat,
    call_schema,
    check_call,
    lark_json,
)

TRIGGER = "[TOOL_CALLS]"


class MistralFormat(ToolFormat):
    name = "mistral"
    calls_at_start = True

    def __init__(self, trigger_token_id: int | None = None):
        self.trigger_token_id = trigger_token_id  # the special token, when the vocab has it

    def parse(self, text: str, tools: list[Tool]) -> ParsedOutput:
        body = text.strip()
        body = body.removeprefix(TRIGGER).lstrip()
        if not body.startswith("["):
            return ParsedOutput(text or None, ())
        try:
            items = json.loads(body)
        except ValueError:
            return ParsedOutput(text, ())
        calls = [check_call(item, tools, ("arguments",)) for item in items] if isinstance(
            items, list) and items else [None]
        if any(c is None for c in calls):
            return ParsedOutput(text, ())
        return ParsedOutput(None, tuple(calls))

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        array = {"type": "array", "items": call_schema(tools), "minItems": 1}
        array["x-guidance"] = array["items"].pop("x-guidance")
        if not parallel:
            array["maxItems"] = 1
        trigger = (f"<[{self.trigger_token_id}]>" if self.trigger_token_id is not None
                   else json.dumps(TRIGGER))
        return f"start: {trigger} calls\ncalls: {lark_json(array)}\n"

    def call_id(self) -> str:
        return "".join(secrets.choice(ALNUM) for _ in range(9))
