"""Tool-call defect rate on the bundled model: the base, an identity adapter (a demo adapter
with every lora_B zeroed: the base's weights under an adapter's route) and a demo adapter, on
the same prompts, each of which calls for one of the tools. A turn is a defect when its output
does not parse into at least one call of a listed tool whose arguments validate against that
tool's schema; turns cut by max_tokens are counted apart ("length") and not judged.
tool_choice "auto": reported (the model may also answer in text); "required": the grammar
makes every finished turn a valid call, so its rate must be 0.

    PYTHONPATH=. .venv/bin/python benchmarks/tool_calls.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jsonschema
import torch
from common import scratch_dir, write_result
from safetensors.torch import load_file, save_file

from loraserve import LLM, SamplingParams
from loraserve.model.bundled import default_model_dir
from loraserve.server.tool_calls import ToolPlan
from loraserve.types import FinishReason

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string"},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add_numbers", "description": "Add two numbers",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email",
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": ["to", "subject"],
                       "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                      "body": {"type": "string"}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What's the weather like in Paris right now?", "Is it raining in Tokyo?",
    "Tell me the temperature in Berlin in fahrenheit.", "How warm is it in Madrid today?",
    "Weather for New York, please.", "What is 17 plus 25?", "Add 3.5 and 8.",
    "Compute the sum of 120 and 45.", "What do I get if I add 9 to 1000?",
    "Please add 2 and 2.", "Send an email to bob@example.com saying the meeting moved.",
    "Email alice@example.com with subject 'Lunch' and ask if she is free.",
    "Write to team@example.com: subject Release, body: we ship on Friday.",
    "Notify carol@example.com by email that the report is ready.",
    "Is it sunny in Rome?", "What's 44 + 56?", "Check the weather in Sydney.",
    "Send an email to dan@example.com about the invoice.", "Add 7 and 13 for me.",
    "How cold is it in Oslo?",
]


def identity_adapter(src: Path, dst: Path) -> Path:
    """`src` with every lora_B zeroed: it changes no output, yet runs on the adapter's route."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "adapter_model.safetensors")
    zeroed = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in weights.items()}
    save_file(zeroed, dst / "adapter_model.safetensors")
    return dst


def verdict(plan: ToolPlan, text: str) -> str:
    parsed = plan.parse(text)
    if not parsed.calls:
        return "text answer" if plan.fmt.trigger not in text else "malformed call"
    for call in parsed.calls:
        try:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        except jsonschema.ValidationError:
            return "invalid arguments"
    return "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    demo = Path(__file__).resolve().parent.parent / "loraserve" / "demo" / "data"
    ident = identity_adapter(demo / "french", scratch_dir("tool_calls") / "identity")
    llm = LLM(default_model_dir(), lora_paths={"identity": str(ident),
                                               "french": str(demo / "french")},
              kv_cache_tokens=32768)
    fmt = llm.tokenizer.tool_format
    routes = {"base": None, "identity": "identity", "french": "french"}
    result = {"format": fmt.name, "prompts": len(PROMPTS), "seeds": args.seeds,
              "temperature": args.temperature}
    for mode in ("auto", "required"):
        plan = ToolPlan(fmt, TOOLS, forced=mode == "required", parallel=False)
        spec = plan.constraint()
        chats, params, loras, keys = [], [], [], []
        for route, lora in routes.items():
            for i, prompt in enumerate(PROMPTS):
                for seed in range(args.seeds):
                    chats.append(llm.tokenizer.apply_chat_template(
                        [{"role": "user", "content": prompt}], tools=TOOLS))
                    params.append(SamplingParams(max_tokens=256, temperature=args.temperature,
                                                 seed=1000 * i + seed, structured_outputs=spec))
                    loras.append(lora)
                    keys.append(route)
        outs = llm.generate(chats, params, lora=loras)
        table = {}
        for route, out in zip(keys, outs, strict=True):
            row = table.setdefault(route, {"turns": 0, "length": 0, "judged": 0, "defects": 0,
                                           "kinds": {}})
            row["turns"] += 1
            if out.finish_reason is FinishReason.LENGTH:
                row["length"] += 1
                continue
            row["judged"] += 1
            kind = verdict(plan, out.text)
            if kind != "ok":
                row["defects"] += 1
                row["kinds"][kind] = row["kinds"].get(kind, 0) + 1
        for row in table.values():
            row["defect_rate"] = row["defects"] / max(1, row["judged"])
        result[mode] = table
    print(json.dumps(result, indent=2))
    print("wrote", write_result("tool_calls", result))


if __name__ == "__main__":
    main()
