"""examples/rl_loop.py end to end on a tiny model: a server it starts itself, rollouts over the
OpenAI client, PEFT training steps, and each new version pushed by upload from memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from model_factory import make_tiny_llama
from server_utils import REPO


@pytest.mark.slow
def test_rl_loop_pushes_increasing_versions(tmp_path):
    model = make_tiny_llama(tmp_path / "model", max_position_embeddings=4096)
    out = tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "rl_loop.py"), "--model", str(model),
         "--iterations", "3", "--prompts", "2", "--n", "3", "--max-tokens", "6",
         "--out", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["pushed_versions"] == [1, 2, 3, 4]
    for it, pushed_before in zip(run["iterations"], [1, 2, 3], strict=True):
        used = {int(v.rsplit("@", 1)[1]) for v in it["rollout_versions"]}
        assert len(it["rollout_versions"]) == 2 * 3
        # rollouts name the version that sampled them: a pushed one, at most --max-lag (1)
        # behind the trainer's
        assert used <= set(range(pushed_before - 1, pushed_before + 1)) - {0}, used
    first = run["iterations"][0]
    # the first batch was sampled from policy@1, the trainer's own weights: the server's
    # logprobs of the sampled tokens are the trainer's (transformers + PEFT) to float error
    assert set(first["rollout_versions"]) == {"policy@1"}
    assert first["max_abs_log_ratio"] < 1e-3
    assert "pushed policy@4" in proc.stdout and "mean reward by the version" in proc.stdout
