"""Llama 3.1-3.3 JSON calls: the whole answer is one call, or several separated by ';'

    {"name": "get_weather", "parameters": {"city": "Paris"}}

(after an optional <|python_tag|>, a special token that never reaches the text)."""

from __future__ import annotations

import json

from loraserve.model.tools.base import (
    ParsedOutput,
    Tool,
    ToolFormat,
    call_schema,
    check_call,
    lark_json,
)


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    calls_at_start = True

    def parse(self, text: str, tools: list[Tool]) -> ParsedOutput:
        body = text.strip()
        if not body.startswith("{"):
            return ParsedOutput(text or None, ())
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return ParsedOutput(text, ())
            call = check_call(obj, tools, ("parameters", "arguments"))
            if call is None:
                return ParsedOutput(text, ())
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return ParsedOutput(None, tuple(calls))

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        repeat = ' ("; " call)*' if parallel else ""
        return f"start: call{repeat}\ncall: {lark_json(call_schema(tools, 'parameters'))}\n"
