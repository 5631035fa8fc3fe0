"""The gpu tier: the engine on a CUDA GPU, against the same references as on the CPU.

Every test here is marked `gpu` (its folder) and skipped where torch sees no CUDA GPU, so the
CPU suite runs none of them. On a GPU machine `benchmarks/gpu_check.sh` runs them
(`pytest -m gpu`). Each LLM a test makes runs on the GPU, in float32 unless the test names a
dtype: the references are float32 transformers + PEFT on the CPU, and float32 on the GPU must
give their greedy tokens exactly (the Triton LoRA dots run in IEEE precision there). Each gets
the CPU's KV cache size unless the test names one.
"""

from __future__ import annotations

import pytest
import torch

from loraserve import LLM


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run benchmarks/gpu_check.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def engines_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    real = LLM.__init__

    def on_cuda(self, *args, **kwargs):
        kwargs.setdefault("device", "cuda")
        kwargs.setdefault("dtype", "float32")
        if "kv_cache_memory" not in kwargs:  # the CPU's default: not 90% of the GPU each, as
            kwargs.setdefault("kv_cache_tokens", 32768)  # pytest's workers share one GPU
        real(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "__init__", on_cuda)
