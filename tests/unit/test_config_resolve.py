"""EngineConfig.resolve settles every automatic choice before the engine is wired: nothing
"auto" (or None standing for a choice) is left, CPU and GPU get their own defaults, explicit
choices are kept, and what the device cannot run is refused. The GPU cases pretend torch sees
one (no tensor is made)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraserve.config import LORA_BACKEND_ENV, EngineConfig

# knobs whose None means "choose for me" (others' None means unbounded or the model's own)
CHOSEN_WHEN_NONE = ("device", "lora_backend", "attention_backend")


def assert_settled(c: EngineConfig) -> None:
    values = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    assert [k for k, v in values.items() if v == "auto"] == []
    assert [k for k in CHOSEN_WHEN_NONE if values[k] is None] == []
    assert c.resolve() == c  # nothing left to choose


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture(autouse=True)
def no_backend_env(monkeypatch):
    monkeypatch.delenv(LORA_BACKEND_ENV, raising=False)


def test_cpu_choices():
    c = EngineConfig().resolve("cpu")
    assert_settled(c)
    assert (c.device, c.dtype, c.lora_dtype, c.lora_memory) == ("cpu", "float32", "float32",
                                                                "unified")
    assert (c.lora_backend, c.attention_backend, c.disable_cuda_graph) == ("cpu", "cpu", True)
    assert c.decode_pace_factor == 3.0


def test_gpu_choices(gpu):
    c = EngineConfig(max_num_seqs=16).resolve("cuda")
    assert_settled(c)
    assert (c.device, c.dtype, c.lora_dtype, c.lora_memory) == ("cuda", "bfloat16",
                                                                "bfloat16", "tiered")
    assert (c.lora_backend, c.attention_backend, c.disable_cuda_graph) == ("triton", "triton",
                                                                           False)
    assert c.cuda_graph_max_bs == 16  # no graph for batches the scheduler never makes
    assert c.decode_pace_factor == 0.0  # a GPU's chunks are not paced by default
    assert EngineConfig(decode_pace_factor=2.0).resolve("cuda").decode_pace_factor == 2.0
    assert EngineConfig(device="cuda:1").resolve().device == "cuda:1"


def test_the_device_defaults_to_what_torch_sees(gpu, monkeypatch):
    assert EngineConfig().resolve().device == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().resolve().device == "cpu"


def test_the_argument_overrides_the_configs_device(gpu):
    assert EngineConfig(device="cuda").resolve("cpu").device == "cpu"
    assert EngineConfig(device="cpu").resolve(torch.device("cuda", 0)).device == "cuda:0"


def test_explicit_choices_are_kept(gpu):
    c = EngineConfig(dtype="float16", lora_memory="unified", lora_backend="torch",
                     attention_backend="triton", lora_dtype="auto").resolve("cuda")
    assert_settled(c)
    assert (c.dtype, c.lora_dtype, c.lora_memory, c.lora_backend) == (
        "float16", "float16", "unified", "torch")
    # a LoRA backend a graph cannot replay: decode steps run eagerly
    assert c.disable_cuda_graph
    c = EngineConfig(lora_memory="tiered", lora_dtype="bfloat16").resolve("cpu")
    assert (c.lora_memory, c.lora_dtype) == ("tiered", "bfloat16")
    assert EngineConfig(disable_cuda_graph=True).resolve("cuda").disable_cuda_graph


def test_the_backend_environment_variable_names_the_cpu_backend_only(gpu, monkeypatch):
    monkeypatch.setenv(LORA_BACKEND_ENV, "Torch")
    assert EngineConfig().resolve("cpu").lora_backend == "torch"
    assert EngineConfig(lora_backend="cpu").resolve("cpu").lora_backend == "cpu"
    assert EngineConfig().resolve("cuda").lora_backend == "triton"
    monkeypatch.setenv(LORA_BACKEND_ENV, "nope")
    with pytest.raises(ValueError, match=f"\\${LORA_BACKEND_ENV}='nope': choose from"):
        EngineConfig().resolve("cpu")


def test_what_the_device_cannot_run_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="dtype float16 needs a GPU"):
        EngineConfig(dtype="float16").resolve("cpu")
    with pytest.raises(ValueError, match="quantization int8 with dtype bfloat16"):
        EngineConfig(quantization="int8", dtype="bfloat16").resolve("cpu")
    with pytest.raises(ValueError, match="runs on cpu or cuda"):
        EngineConfig().resolve("meta")
    with pytest.raises(ValueError, match="device 'gpu0'"):
        EngineConfig().resolve("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        EngineConfig().resolve("cuda")


def test_a_lora_dtype_outside_the_choices_only_as_the_models_own():
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        EngineConfig(lora_dtype="float16")
    assert EngineConfig(dtype="float16", lora_dtype="float16").lora_torch_dtype == torch.float16


def test_bf16_on_cpu_is_the_weights_only():
    """On CPU, bfloat16 is the projections' weights: activations, the KV cache and adapters
    stay float32 unless lora_dtype says otherwise; on a GPU it is everything."""
    cpu = EngineConfig(dtype="bfloat16").resolve("cpu")
    assert (cpu.dtype, cpu.activation_dtype, cpu.lora_dtype) == ("bfloat16", "float32",
                                                                 "float32")
    assert EngineConfig(dtype="bfloat16", lora_dtype="bfloat16").resolve("cpu").lora_dtype \
        == "bfloat16"
    assert EngineConfig().resolve("cpu").activation_dtype == "float32"
