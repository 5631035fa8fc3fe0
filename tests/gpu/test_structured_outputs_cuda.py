"""Structured outputs on the GPU: the grammar's token masks (built on the host) applied to
logits on the device, in mixed adapter batches under every sampling filter, with n choices,
the prefix cache and preemption (tests/engine/test_structured_outputs.py's cases on CUDA)."""

from __future__ import annotations

import test_structured_outputs as cpu_cases
from test_structured_outputs import (  # noqa: F401  (collected here again, on the GPU)
    adapters,
    test_n_choices_and_prefix_cache_keep_their_own_grammar_state,
    test_preempted_constrained_requests_resume_their_grammar,
)


def test_every_output_satisfies_its_constraint_in_mixed_batches_on_the_gpu(
        tiny_model_dir, adapters):  # noqa: F811
    cpu_cases.test_every_output_satisfies_its_constraint_in_mixed_batches(
        tiny_model_dir, adapters, "triton")
