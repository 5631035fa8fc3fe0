"""Tools on /v1/chat/completions: what the prompt renders, what the grammar forces, and how
the output becomes OpenAI's `message.tool_calls` (whole or streamed).

tool_choice "auto": the model may answer or call; its output is parsed by the family's format
(model/tools/). "required" and a named function: a grammar over the format's syntax makes the
output exactly one call (or several, with parallel_tool_calls) of the given tools, arguments
valid against their schemas. "none": the tools are not rendered and nothing is parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loraserve.model.tools import ParsedOutput, ToolFormat
from loraserve.server.formatting import DeltaTracker
from loraserve.types import FinishReason, RequestOutput, StructuredOutput


@dataclass(frozen=True)
class ToolPlan:
    fmt: ToolFormat
    tools: list[dict]  # the tools the output may call
    forced: bool  # "required" or a named function: a grammar binds the output
    parallel: bool

    def constraint(self) -> StructuredOutput | None:
        if not self.forced:
            return None
        return StructuredOutput("grammar", self.fmt.grammar(self.tools, self.parallel))

    def parse(self, text: str) -> ParsedOutput:
        parsed = self.fmt.parse(text, self.tools)
        if not self.parallel and len(parsed.calls) > 1:
            parsed = ParsedOutput(parsed.content, parsed.calls[:1])
        return parsed

    def streamable(self, text: str) -> str:
        """The prefix of an unfinished output that is content whatever follows."""
        if self.forced:
            return ""
        if self.fmt.calls_at_start:
            head = text.lstrip()
            return "" if not head or head[0] in "{[" else text
        trigger = self.fmt.trigger or ""
        at = text.find(trigger)
        if at >= 0:
            return text[:at]
        for n in range(min(len(trigger) - 1, len(text)), 0, -1):
            if trigger.startswith(text[-n:]):
                return text[:-n]
        return text

    def tool_calls(self, parsed: ParsedOutput) -> list[dict]:
        return [{"id": self.fmt.call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.calls]


def tool_plan(req, tool_format: ToolFormat) -> ToolPlan | None:
    """None when the request has no tools or tool_choice is "none"."""
    choice = req.tool_choice or ("auto" if req.tools else "none")
    if not req.tools or choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(choice, str):
        return ToolPlan(tool_format, tools, choice == "required", req.parallel_tool_calls)
    named = [t for t in tools if t["function"]["name"] == choice.function.name]
    return ToolPlan(tool_format, named, True, False)


def tool_choice_message(plan: ToolPlan, choice: dict, out: RequestOutput) -> dict:
    """A full chat choice with its text parsed into tool calls, when it holds any."""
    parsed = plan.parse(out.text)
    if not parsed.calls:
        return choice
    message = {"role": "assistant", "content": parsed.content,
               "tool_calls": plan.tool_calls(parsed)}
    return {**choice, "message": message, "finish_reason": _finish(out, choice)}


def _finish(out: RequestOutput, choice: dict) -> str | None:
    return "tool_calls" if out.finish_reason is FinishReason.STOP else choice["finish_reason"]


class ToolDeltaTracker(DeltaTracker):
    """Streams content up to where a call may begin; the calls go out, whole, in the last
    chunk (OpenAI's tool_calls deltas: index, id, type, name, then the arguments)."""

    def __init__(self, index: int, lp, plan: ToolPlan):
        super().__init__(index, lp, chat=True)
        self.plan = plan

    def delta(self, out: RequestOutput) -> dict | None:
        if not out.finished:
            prefix = self.plan.streamable(out.text)
            cut = len(out.text) - len(prefix)
            return super().delta(replace(out, text=prefix, holdback=max(0, out.holdback - cut)))
        parsed = self.plan.parse(out.text)
        if not parsed.calls:
            return super().delta(out)  # everything held back is content after all
        choice = super().delta(replace(out, text=out.text[:self.sent_chars]))
        calls = [{"index": k, **c} for k, c in enumerate(self.plan.tool_calls(parsed))]
        choice["delta"] = {**choice["delta"], "tool_calls": calls}
        choice["finish_reason"] = _finish(out, choice)
        return choice
