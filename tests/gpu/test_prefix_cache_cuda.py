"""The prefix cache and forks on the GPU: outputs with the cache equal outputs without it
(plain, chunked, preempted), and forks share the prompt's blocks, copy the partial one on the
device and give what the same request alone gives (tests/engine/test_prefix_cache.py's cases,
collected here again and run on CUDA)."""

from __future__ import annotations

from test_prefix_cache import (  # noqa: F401  (collected here again, on the GPU)
    ads,
    test_a_fork_whose_parent_ended_early_still_gets_its_answer,
    test_forks_share_the_prompt_copy_the_partial_block_and_inherit_the_adapter,
    test_outputs_with_the_cache_equal_outputs_without,
)
