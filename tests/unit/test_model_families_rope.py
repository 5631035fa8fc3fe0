"""Our rotary frequencies and attention factor equal transformers' own rope init functions for
every rope type we serve, over the parameters each one reads."""

from __future__ import annotations

import pytest
import torch

from loraserve.model.families import model_config_from_hf
from loraserve.model.rope import inv_freq

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
CASES = {
    "default": dict(rope_type="default"),
    "linear": dict(rope_type="linear", factor=2.5),
    "dynamic": dict(rope_type="dynamic", factor=2.0),  # at init: default inside the context
    "llama3": LLAMA3,
    "llama3-other-bands": {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 16.0},
    "yarn": YARN,
    "yarn-betas-no-truncate": {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "yarn-mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-attention-factor": {**YARN, "attention_factor": 1.3},
    "yarn-factor-below-one": {**YARN, "factor": 1.0},
    # Phi-3: short factors (filled in per head size below); attention factor from the
    # context ratio (512 / 64), or from `factor`, or given
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=64),
    "longrope-factor": dict(rope_type="longrope", original_max_position_embeddings=64,
                            factor=4.0),
    "longrope-attention-factor": dict(rope_type="longrope", attention_factor=1.1,
                                      original_max_position_embeddings=64),
}


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_rope_equals_transformers(case, head_dim):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {**CASES[case], "rope_theta": 500000.0 if head_dim == 128 else 10000.0}
    if params["rope_type"] == "longrope":
        params["short_factor"] = [1.0 + 0.1 * i for i in range(head_dim // 2)]
        params["long_factor"] = [8.0] * (head_dim // 2)
    hf = AutoConfig.for_model("llama", hidden_size=4 * head_dim, num_attention_heads=4,
                              head_dim=head_dim, max_position_embeddings=512,
                              rope_parameters=params)
    init = ROPE_INIT_FUNCTIONS.get(params["rope_type"],
                                   LlamaRotaryEmbedding.compute_default_rope_parameters)
    want_freq, want_factor = init(hf)
    mc = model_config_from_hf({**hf.to_dict(), "vocab_size": 32, "intermediate_size": 32,
                               "num_hidden_layers": 1})
    got = inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling)
    # transformers computes in float32, we in float64
    torch.testing.assert_close(got.float(), want_freq.float(), rtol=1e-6, atol=0)
    assert mc.rope_scaling.attention_factor == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_longrope_caps_the_context_where_its_short_factors_end(model_type):
    # transformers switches every position to the long factors once a sequence passes
    # original_max_position_embeddings; we serve the short ones only, so never past it.
    from transformers import AutoConfig

    params = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
                  short_factor=[1.5] * 8, long_factor=[4.0] * 8)
    # Phi-3 states original_max_position_embeddings at the top level too (and it wins)
    top = dict(original_max_position_embeddings=64) if model_type == "phi3" else {}
    hf = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4,
                              max_position_embeddings=512, rope_parameters=params, **top)
    mc = model_config_from_hf({**hf.to_dict(), "vocab_size": 32, "intermediate_size": 32,
                               "num_hidden_layers": 1})
    assert mc.rope_scaling.rope_type == "longrope" and mc.max_position_embeddings == 64
