"""Which tool-call format a model speaks, from its chat template and vocabulary. The base
model's tokenizer decides it, so every adapter route uses the base's template and parser."""

from __future__ import annotations

from loraserve.model.tools.base import ToolFormat
from loraserve.model.tools.hermes import HermesFormat
from loraserve.model.tools.llama3 import Llama3JsonFormat
from loraserve.model.tools.mistral import TRIGGER, MistralFormat


def detect_tool_format(chat_template: str | None, vocab: dict[str, int]) -> ToolFormat:
    template = chat_template or ""
    renders_tools = "tools" in template
    if TRIGGER in template or TRIGGER in vocab:
        return MistralFormat(vocab.get(TRIGGER))
    if "<tool_call>" in template:
        return HermesFormat(native=renders_tools)
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonFormat()
    # A template that renders no tools (SmolLM2, plain ChatML): Hermes, written into the
    # messages by us.
    return HermesFormat(native=False)
