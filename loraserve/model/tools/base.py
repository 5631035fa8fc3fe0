"""What every tool-call format shares: the parsed call, the format's interface, and the JSON
schema of one call (the grammar that "required" and a named tool_choice enforce)."""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass

from loraserve.model.structured.compiler import JSON_OPTIONS

Tool = dict  # OpenAI's {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # text outside the calls (None when there is none)
    calls: tuple[ToolCall, ...]


class ToolFormat(ABC):
    """One family's tool-call syntax. `native`: the chat template renders `tools` and the
    tool/assistant-call messages itself; else `render_messages` writes them into the messages
    (then the template only sees plain system/user/assistant turns)."""

    name: str
    native: bool = True
    # the output that begins calls: text before it streams as content ("auto")
    trigger: str | None = None
    # calls only at the start of the output (the whole answer is one JSON value)
    calls_at_start: bool = False

    @abstractmethod
    def parse(self, text: str, tools: list[Tool]) -> ParsedOutput:
        """The calls in a finished output. Calls that are not valid JSON, or name a function
        not in `tools`, leave the whole text as content and no call."""

    @abstractmethod
    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        """A Lark grammar (llguidance) whose sentences are exactly valid calls of `tools`."""

    def render_messages(self, messages: list[dict], tools: list[Tool]) -> list[dict]:
        return messages

    def call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"


def function(tool: Tool) -> dict:
    return tool["function"]


def parameters(tool: Tool) -> dict:
    return function(tool).get("parameters") or {"type": "object", "properties": {}}


def call_schema(tools: list[Tool], args_key: str = "arguments") -> dict:
    """{"name": one of the tools, args_key: that tool's parameters}; whitespace bounded."""
    options = [{"type": "object",
                "properties": {"name": {"const": function(t)["name"]}, args_key: parameters(t)},
                "required": ["name", args_key], "additionalProperties": False} for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"x-guidance": JSON_OPTIONS, **schema}


def lark_json(schema: dict) -> str:
    return "%json " + json.dumps(schema)


def check_call(obj: object, tools: list[Tool], args_keys: tuple[str, ...]) -> ToolCall | None:
    """A parsed {"name", "arguments"} object as a ToolCall, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in {function(t)["name"] for t in tools}:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def arguments_object(call: dict) -> dict:
    """An assistant message's tool call's arguments as a dict (templates expect one)."""
    args = call.get("function", {}).get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise ValueError(f"a tool call's arguments are not valid JSON: {e}") from e
    return args


ALNUM = string.ascii_letters + string.digits
