"""KV cache sizing (engine/kv_sizing.py): tokens, a byte budget, or a GPU memory share; the
GPU arithmetic is checked with a stated device reading, the rest on a real engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraserve import LLM, SamplingParams
from loraserve.cli import build_parser, engine_config_from_args
from loraserve.config import EngineConfig, ModelConfig
from loraserve.engine.kv_sizing import (
    DEFAULT_CPU_TOKENS,
    GIB,
    GpuMemory,
    kv_bytes_per_token,
    size_kv_cache,
    step_activation_bytes,
)

MC = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=64, name="llama-3.2-1b-shapes")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_per_token_bytes_count_k_and_v_of_every_layer():
    assert kv_bytes_per_token(MC, torch.bfloat16) == 2 * 16 * 8 * 64 * 2  # 32 KiB


def test_precedence_tokens_then_bytes_then_the_device_default():
    assert size_kv_cache(EngineConfig(kv_cache_tokens=1000, block_size=16), MC, CPU,
                         torch.float32).tokens == 992  # whole blocks
    per = kv_bytes_per_token(MC, torch.float32)
    s = size_kv_cache(EngineConfig(kv_cache_memory=100 * per + 5), MC, CPU, torch.float32)
    assert (s.tokens, s.nbytes) == (96, 96 * per)
    assert size_kv_cache(EngineConfig(), MC, CPU, torch.float32).tokens == DEFAULT_CPU_TOKENS


def test_a_budget_below_one_block_is_refused_naming_it():
    with pytest.raises(ValueError, match="kv_cache_memory=1000 leaves the KV cache 0 tokens"):
        size_kv_cache(EngineConfig(kv_cache_memory=1000), MC, CPU, torch.float32)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_cache_tokens=64, kv_cache_memory=10**6)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_gpu_share_leaves_the_cache_what_weights_slots_and_activations_do_not_use():
    c = EngineConfig(gpu_memory_utilization=0.5)
    reading = GpuMemory(free=78 * GIB, total=80 * GIB, allocated=3 * GIB,
                        reserved=int(3.5 * GIB))
    s = size_kv_cache(c, MC, CUDA, torch.bfloat16, probe=lambda d: reading)
    budget = 40 * GIB - 3 * GIB - step_activation_bytes(MC, c, torch.bfloat16)
    per = kv_bytes_per_token(MC, torch.bfloat16)
    assert s.tokens == budget // per // 16 * 16
    assert 0 < budget - s.nbytes < 16 * per


def test_gpu_share_larger_than_what_other_processes_leave_is_refused():
    reading = GpuMemory(free=10 * GIB, total=80 * GIB, allocated=2 * GIB, reserved=2 * GIB)
    with pytest.raises(ValueError, match="other processes hold 68.00 GiB"):
        size_kv_cache(EngineConfig(), MC, CUDA, torch.bfloat16, probe=lambda d: reading)


def test_engine_allocates_what_the_byte_budget_allows(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory=3 << 20, block_size=4)
    eng = llm.engine
    per = kv_bytes_per_token(eng.model_config, torch.float32)
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in eng.runner.kv_caches)
    assert eng.kv.capacity_tokens == (3 << 20) // per // 4 * 4
    assert cache_bytes == eng.kv.capacity_tokens * per <= 3 << 20
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_cli_flags_reach_the_config():
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "1073741824",
                                      "--gpu-memory-utilization", "0.8"])
    cfg = engine_config_from_args(args)
    assert dataclasses.replace(cfg) == EngineConfig(kv_cache_memory=1 << 30,
                                                    gpu_memory_utilization=0.8)
