"""The command line's engine flags are generated from EngineConfig: every field has its flag
and default, values reach the config, bad values are refused clearly, and the CLI module and
the server's flag module do not import each other."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from loraserve.cli import build_parser, engine_config_from_args
from loraserve.config import LORA_BACKEND_NAMES, EngineConfig

ROOT = Path(__file__).resolve().parents[2] / "loraserve"


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_every_field_is_a_flag_with_the_config_default():
    args = parse()
    for f in dataclasses.fields(EngineConfig):
        assert getattr(args, f.name) == f.default, f.name
        assert f.metadata.get("help"), f"{f.name} has no help text"
    assert engine_config_from_args(args) == EngineConfig()


def test_values_reach_the_config():
    args = parse("--block-size", "32", "--starvation-steps", "5", "--max-loaded-loras", "3",
                 "--allow-pickle-adapters", "--seed", "7", "--lora-backend", "torch",
                 "--lora-dtype", "bfloat16")
    config = engine_config_from_args(args)
    assert (config.block_size, config.starvation_steps, config.max_loaded_loras) == (32, 5, 3)
    assert config.allow_pickle_adapters and config.seed == 7
    assert (config.lora_backend, config.lora_dtype) == ("torch", "bfloat16")


def test_generate_keeps_seed_for_sampling():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--seed", "3"])
    assert args.seed == 3 and engine_config_from_args(args).seed == 0


def test_bad_values_are_refused_clearly(capsys):
    with pytest.raises(SystemExit):
        parse("--lora-backend", "nope")
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    for argv, message in [(("--max-loras-per-batch", "0"), "max_loras_per_batch must be >= 1"),
                          (("--kv-cache-tokens", "8", "--block-size", "16"),
                           "kv_cache_tokens must hold at least one block")]:
        with pytest.raises(SystemExit) as exit_info:
            engine_config_from_args(parse(*argv))
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == f"loraserve serve: {message}"


def test_backend_names_match_the_registry():
    from loraserve.lora.backends import LORA_BACKENDS

    assert set(LORA_BACKENDS) == set(LORA_BACKEND_NAMES)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_cli_and_server_flags_do_not_import_each_other():
    assert "loraserve.cli" not in imports_of(ROOT / "server" / "cli_args.py")
    for path in (ROOT / "config").glob("*.py"):
        assert not any(m.startswith("loraserve.server") for m in imports_of(path)), path


def run_cli(*argv: str, timeout: float = 60):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    return subprocess.run([sys.executable, "-m", "loraserve", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT.parent)


def test_version_and_module_entry_point():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("loraserve ")


def test_serve_fails_fast_with_one_line(tiny_model_dir, tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        r = run_cli("serve", "--model", str(tiny_model_dir), "--port", port)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    # the one line is all it says: the model was never loaded (loading logs "loading ...")
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    for item, fragment in [(f"x={tmp_path / 'missing'}", "does not exist"),
                           ("good\n=/tmp", "invalid adapter name"), ("noequals", "NAME=PATH")]:
        r = run_cli("serve", "--model", str(tmp_path / "no-model"), "--port", "0",
                    "--lora-paths", item)
        assert r.returncode == 2 and fragment in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_generate_mistakes_are_one_line(tiny_model_dir, tmp_path):
    for argv, fragment in [(["--model", str(tmp_path / "none")], "does not exist"),
                           (["--model", str(tiny_model_dir), "--lora", "nope"], "'nope'")]:
        r = run_cli("generate", "--prompt", "hi", "--max-tokens", "1", *argv, timeout=120)
        assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr


def test_device_and_dtype_this_machine_cannot_run_are_refused(tiny_model_dir):
    import torch

    from loraserve import LLM

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda': torch sees no CUDA GPU"):
            LLM(str(tiny_model_dir), device="cuda")
    with pytest.raises(ValueError, match="dtype float16 needs a GPU"):
        LLM(str(tiny_model_dir), device="cpu", dtype="float16")
    with pytest.raises(ValueError, match="loraserve runs on cpu or cuda"):
        LLM(str(tiny_model_dir), device="meta")
    llm = LLM(str(tiny_model_dir), device="cpu")
    assert llm.engine.device.type == "cpu" and llm.engine.model.embed.dtype == torch.float32
