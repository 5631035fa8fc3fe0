"""What we do not compute exactly is refused at load, in one line naming the architecture or
the config field, never served approximately (nor with a traceback from the CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_factory import make_tiny_family

from loraserve import LLM
from loraserve.model.families import model_config_from_hf, read_model_config

ROOT = Path(__file__).resolve().parents[2]

# model_type -> (extra config fields, what the error must name)
REFUSED_FAMILIES = {
    "gpt_oss": (dict(num_local_experts=2, num_experts_per_tok=1, head_dim=16),
                "GptOssForCausalLM"),
    "gpt2": ({}, "GPT2LMHeadModel"),
}

# Families we serve, with a field we do not compute exactly: (model_type, fields, named)
REFUSED_FIELDS = {
    "gelu": ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    "gemma2-gelu": ("gemma2", dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    "gemma3-bidirectional": ("gemma3_text", dict(use_bidirectional_attention=True),
                             "use_bidirectional_attention"),
    "gemma3-local-rope-scaled": ("gemma3_text", dict(rope_parameters=dict(
        full_attention=dict(rope_type="default", rope_theta=1e6),
        sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
        "sliding_attention"),
    "qwen2-moe-dense-layers": ("qwen2_moe", dict(num_experts=2, num_experts_per_tok=1,
                                                  moe_intermediate_size=32,
                                                  mlp_only_layers=[0]), "mlp_only_layers"),
    "granite-zero-multiplier": ("granite", dict(residual_multiplier=0.0),
                                "residual_multiplier"),
    "partial-rotary": ("llama", dict(rope_parameters=dict(rope_type="default",
                                                          rope_theta=10000.0,
                                                          partial_rotary_factor=0.5)),
                       "partial_rotary_factor"),
}


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg.strip(), msg
    return msg


@pytest.fixture(scope="module")
def refused_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("refused")
    return {mt: make_tiny_family(root / mt, mt, **fields)
            for mt, (fields, _) in REFUSED_FAMILIES.items()}


@pytest.mark.parametrize("model_type", list(REFUSED_FAMILIES))
def test_unsupported_family_is_refused_naming_it(model_type, refused_dirs):
    with pytest.raises(ValueError) as e:
        LLM(str(refused_dirs[model_type]))
    msg = one_line(e.value)
    assert REFUSED_FAMILIES[model_type][1] in msg and "not supported" in msg, msg


@pytest.mark.parametrize("case", list(REFUSED_FIELDS))
def test_unsupported_field_is_refused_naming_it(case, tmp_path):
    model_type, fields, named = REFUSED_FIELDS[case]
    with pytest.raises(ValueError) as e:
        read_model_config(make_tiny_family(tmp_path, model_type, **fields))
    msg = one_line(e.value)
    assert named in msg and "ForCausalLM" in msg, msg


@pytest.mark.parametrize("raw, named", [
    ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
     "LlamaForSequenceClassification"),
    ({"architectures": ["LlamaForCausalLM"]}, "model_type None"),
    ({"model_type": "llama", "architectures": "LlamaForCausalLM"}, "architectures"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}, "multiple"),
    ({"model_type": "smollm3", "num_hidden_layers": 2, "no_rope_layers": [1]},
     "invalid config.json"),
    ({"model_type": "llama", "rope_parameters": {
        "full_attention": {"rope_type": "default"}}}, "rope"),
])
def test_malformed_configs_are_one_line(raw, named):
    with pytest.raises(ValueError) as e:
        model_config_from_hf(raw)
    assert named in one_line(e.value)


def test_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="JSON object"):
        read_model_config(tmp_path)


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "loraserve", *argv], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_refuses_a_family_in_one_line(command, refused_dirs):
    model = str(refused_dirs["gpt_oss"])
    extra = ["--prompt", "hi", "--max-tokens", "1"] if command == "generate" else ["--port", "0"]
    r = run_cli(command, "--model", model, *extra)
    assert r.returncode == 2, r.stderr
    # serve logs its start-up steps before it gets to the model; the refusal is one line
    lines = [ln for ln in r.stderr.strip().splitlines() if " INFO loraserve." not in ln]
    assert len(lines) == 1 and "GptOssForCausalLM" in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize("raw, named", [
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     "multimodal Gemma 3"),
    ({"model_type": "olmo", "architectures": ["OlmoForCausalLM"]}, "OlmoForCausalLM"),
    ({"model_type": "phi", "architectures": ["PhiForCausalLM"]}, "PhiForCausalLM"),
])
def test_lookalike_families_are_refused_by_name(raw, named):
    # names close to served families (Gemma 3 text, OLMo 2, Phi-3) that compute otherwise
    with pytest.raises(ValueError) as e:
        model_config_from_hf(raw)
    assert named in one_line(e.value) and "not supported" in str(e.value)
