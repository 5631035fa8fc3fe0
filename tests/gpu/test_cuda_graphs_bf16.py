"""In bfloat16, the model's serving dtype on a GPU, decode steps replayed from CUDA graphs give
exactly the tokens of the same steps run eagerly, for base rows and mixed adapters.

There is no float32 reference to match in bf16; what must hold is that a graph is the same
computation as the eager step. Batches are whole graph buckets (1, 2, 4, 8 sequences), so a
replay multiplies the same shapes as the eager step (a padded bucket may pick other GEMM
kernels, which round differently).
"""

from __future__ import annotations

import pytest
from test_multi_lora_reference import tiny_setup  # noqa: F401

from loraserve import LLM, SamplingParams

TOKENS = 24


def tokens(model_dir, paths, prompts, loras, **knobs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), lora_paths=paths, dtype="bfloat16", max_lora_rank=64,
              enable_prefix_caching=False, **knobs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                ignore_eos=True), lora=loras)
    assert all(o.error is None for o in outs)
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_graph_replays_equal_eager_steps_in_bf16(tiny_model_dir, tiny_setup, batch):  # noqa: F811
    prompts, paths, _ = tiny_setup
    groups = list(prompts)  # six adapters and None (the base model)
    order = [(groups[i % len(groups)], i // len(groups)) for i in range(batch)]
    batch_prompts = [prompts[g][i] for g, i in order]
    loras = [g for g, _ in order]
    replayed, llm = tokens(tiny_model_dir, paths, batch_prompts, loras)
    eager, _ = tokens(tiny_model_dir, paths, batch_prompts, loras, disable_cuda_graph=True)
    assert replayed == eager
    used = {k: g.replays for k, g in llm.engine.runner.graphs.graphs.items()}
    with_lora = any(g is not None for g in loras)
    assert used.get((batch, with_lora), 0) >= TOKENS - 2, used
