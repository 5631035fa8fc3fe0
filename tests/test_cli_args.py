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

ROOT = Path(__file__).resolve().parent.parent / "loraserve"


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
    with pytest.raises(SystemExit, match="max_loras_per_batch must be >= 1"):
        engine_config_from_args(parse("--max-loras-per-batch", "0"))
    with pytest.raises(SystemExit, match="kv_cache_tokens must hold at least one block"):
        engine_config_from_args(parse("--kv-cache-tokens", "8", "--block-size", "16"))


def test_backend_names_match_the_registry():
    from loraserve.lora.backends import LORA_BACKENDS

    assert set(LORA_BACKENDS) == set(LORA_BACKEND_NAMES)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_cli_and_server_flags_do_not_import_each_other():
    assert "loraserve.cli" not in imports_of(ROOT / "server" / "cli_args.py")
    assert not any(m.startswith("loraserve.server") for m in imports_of(ROOT / "config.py"))
