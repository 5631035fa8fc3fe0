"""`loraserve generate --json` prints one JSON line per prompt, equal to the offline API's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraserve import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]


def test_cli_generate_json_equals_offline_api(tiny_model_dir):
    cmd = [sys.executable, "-m", "loraserve.cli", "generate", "--model", str(tiny_model_dir),
           "--prompt", "a", "--prompt", "b", "--max-tokens", "5", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 2, proc.stdout

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = LLM(str(tiny_model_dir)).generate(
            ["a", "b"], SamplingParams(max_tokens=5, temperature=0.0))
    finally:
        torch.set_num_threads(before)
    for line, prompt, out in zip(lines, ["a", "b"], outs, strict=True):
        assert line["prompt"] == prompt and line["lora"] is None
        assert line["token_ids"] == out.token_ids and len(out.token_ids) >= 1
        assert line["text"] == out.text
        assert line["finish_reason"] == out.finish_reason.value


def test_lora_dtype_knob_from_cli_to_config():
    from loraserve.cli import build_parser, engine_config_from_args
    from loraserve.config import EngineConfig

    args = build_parser().parse_args(["generate", "--prompt", "x", "--lora-dtype", "bfloat16"])
    assert engine_config_from_args(args).lora_torch_dtype == torch.bfloat16
    assert EngineConfig().lora_torch_dtype == torch.float32  # auto: the model's dtype
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        EngineConfig(lora_dtype="float8")
