"""Mixed-adapter batches on the GPU give PEFT's greedy tokens, with decode steps replayed from
CUDA graphs (the default there) and run eagerly.

The engine's own cases (tests/engine/test_multi_lora_reference.py: six adapters of different
ranks, targets and scalings plus base rows in one batch; slot reassignment, chunked prefill,
host evictions, preemption) run here again on the GPU (conftest.py).
"""

from __future__ import annotations

import pytest
import test_multi_lora_reference as cases
from test_multi_lora_reference import CONFIGS, MAX_TOKENS, run_mixed, tiny_setup  # noqa: F401

# every configuration but one memory of packed host entries read by the kernel in place: that
# is the CPU's layout; a GPU's adapters are always tiered (host entries, device slots)
GPU_CONFIGS = [name for name in CONFIGS if name != "unified-churn"]


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_mixed_batch_equals_peft_on_the_gpu(tiny_model_dir, tiny_setup, name):  # noqa: F811
    cases.test_tiny_mixed_batch_equals_peft(tiny_model_dir, tiny_setup, name)


def graph_replays(llm) -> dict[tuple[int, bool], int]:
    graphs = llm.engine.runner.graphs
    return {} if graphs is None else {k: g.replays for k, g in graphs.graphs.items()}


def test_the_mixed_batch_replays_decode_graphs_with_adapters(tiny_model_dir, tiny_setup):  # noqa: F811
    prompts, paths, refs = tiny_setup
    outs, _, llm = run_mixed(tiny_model_dir, paths, prompts, MAX_TOKENS)
    assert llm.engine.info.lora_backend == "triton"
    assert {k: o.token_ids for k, o in outs.items()} == refs
    used = graph_replays(llm)
    assert any(n for (_, lora), n in used.items() if lora), used


def test_the_mixed_batch_without_graphs_equals_peft(tiny_model_dir, tiny_setup):  # noqa: F811
    prompts, paths, refs = tiny_setup
    outs, _, llm = run_mixed(tiny_model_dir, paths, prompts, MAX_TOKENS,
                             disable_cuda_graph=True)
    assert llm.engine.runner.graphs is None
    assert {k: o.token_ids for k, o in outs.items()} == refs
