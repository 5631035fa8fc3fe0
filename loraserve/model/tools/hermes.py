"""Hermes-style calls (Qwen2.5, Qwen3, SmolLM3, and the fallback for templates that render no
tools, such as SmolLM2's):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json

from loraserve.model.tools.base import (
    ParsedOutput,
    Tool,
    ToolFormat,
    arguments_object,
    call_schema,
    check_call,
    lark_json,
)

_END = "</tool_call>"


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class HermesFormat(ToolFormat):
    name = "hermes"
    trigger = "<tool_call>"

    def __init__(self, native: bool = True):
        self.native = native

    def parse(self, text: str, tools: list[Tool]) -> ParsedOutput:
        """Each call's JSON is decoded where it begins, not cut at the first end tag: a string
        argument may hold "</tool_call>" (the grammar allows it, and sampling writes it)."""
        start = text.find(self.trigger)
        if start < 0:
            return ParsedOutput(text or None, ())
        decoder, calls, at = json.JSONDecoder(), [], start
        while at >= 0:
            body = _skip_space(text, at + len(self.trigger))
            try:
                obj, end = decoder.raw_decode(text, body)
                call = check_call(obj, tools, ("arguments",))
            except ValueError:
                call = None
            if call is None:
                return ParsedOutput(text, ())
            end = _skip_space(text, end)
            if text.startswith(_END, end):
                end += len(_END)
            elif end < len(text):  # neither the end tag nor the end of the text
                return ParsedOutput(text, ())
            calls.append(call)
            at = text.find(self.trigger, end)
        return ParsedOutput(text[:start].strip() or None, tuple(calls))

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{repeat}\n"
                'call: "<tool_call>\\n" args "\\n</tool_call>"\n'
                f"args: {lark_json(call_schema(tools))}\n")

    def render_messages(self, messages: list[dict], tools: list[Tool]) -> list[dict]:
        """For templates without tools: the tools in the system prompt, calls and results as
        text, the way Hermes-trained templates write them."""
        if self.native:
            return messages
        out = [dict(m) for m in messages]
        if tools:
            listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            prompt = SYSTEM_PROMPT.format(tools=listing)
            if out and out[0].get("role") == "system":
                out[0]["content"] = f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()
            else:
                out.insert(0, {"role": "system", "content": prompt})
        for m in out:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                blocks = [json.dumps({"name": c["function"]["name"],
                                      "arguments": arguments_object(c)}, ensure_ascii=False)
                          for c in m.pop("tool_calls")]
                text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
                m["content"] = f"{m.get('content') or ''}\n{text}".lstrip("\n")
            elif m.get("role") == "tool":
                m.pop("tool_call_id", None)
                m["role"] = "user"
                m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        return out
