"""Every served family, dense and mixture of experts, computes on the GPU what transformers +
PEFT compute on the CPU: the engine's family cases (tests/engine/test_model_families.py,
test_moe_models.py) run again here on CUDA, with the triton LoRA and attention backends.
"""

from __future__ import annotations

import pytest
from test_model_families import (  # noqa: F401  (collected here again, on the GPU)
    test_family_mixed_batch_equals_transformers_and_peft,
)
from test_moe_models import FAMILIES, _check


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_mixed_batch_equals_transformers_and_peft_on_the_gpu(family, tmp_path_factory):
    _check(tmp_path_factory, family, "triton")
