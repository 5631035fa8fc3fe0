"""Tool calling: each model family's call syntax (parse, grammar, rendering) and its
detection."""

from loraserve.model.tools.base import ParsedOutput, Tool, ToolCall, ToolFormat
from loraserve.model.tools.detect import detect_tool_format
from loraserve.model.tools.hermes import HermesFormat
from loraserve.model.tools.llama3 import Llama3JsonFormat
from loraserve.model.tools.mistral import MistralFormat

__all__ = ["HermesFormat", "Llama3JsonFormat", "MistralFormat", "ParsedOutput", "Tool",
           "ToolCall", "ToolFormat", "detect_tool_format"]
