"""The grammars behind tool_choice "required" and a named function: for every format, sampled
outputs at temperature 1.0 (base and adapter rows in one batch) always parse into calls whose
arguments validate against their tool's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from lora_reference import make_adapters

from loraserve import LLM, SamplingParams
from loraserve.model.tools import HermesFormat, Llama3JsonFormat, MistralFormat
from loraserve.types import FinishReason, StructuredOutput

TOOLS = [{"type": "function", "function": {"name": "set_alarm", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["hour", "label"],
             "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                            "label": {"type": "string", "maxLength": 6}}}}},
         {"type": "function", "function": {"name": "toggle", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["on"],
             "properties": {"on": {"type": "boolean"}}}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("fmt", [HermesFormat(), Llama3JsonFormat(), MistralFormat()],
                         ids=lambda f: f.name)
def test_forced_calls_parse_and_validate(tiny_model_dir, tmp_path, fmt):
    adapters = make_adapters(tiny_model_dir, tmp_path, {
        "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=1)})
    llm = LLM(str(tiny_model_dir), lora_paths={"a": str(adapters["a"])}, lora_backend="torch")
    cases = [(TOOLS, True), (TOOLS, False), (TOOLS[1:], False)]
    params, tools_of = [], []
    for i in range(12):
        tools, parallel = cases[i % len(cases)]
        spec = StructuredOutput("grammar", fmt.grammar(tools, parallel))
        params.append(SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                                     structured_outputs=spec))
        tools_of.append((tools, parallel))
    outs = llm.generate([[5 + i, 9, 77] for i in range(12)], params,
                        lora=[None, "a"] * 6)
    for out, (tools, parallel) in zip(outs, tools_of, strict=True):
        if parallel and out.finish_reason is FinishReason.LENGTH:
            continue  # several calls may run past max_tokens
        assert out.finish_reason is FinishReason.STOP, out.text
        parsed = fmt.parse(out.text, tools)
        assert parsed.calls, out.text
        assert parallel or len(parsed.calls) == 1
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
