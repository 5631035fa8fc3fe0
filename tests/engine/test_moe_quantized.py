"""Base weights stored below float32 on a mixture-of-experts model: under --quantization
int8|int4, and bf16 under --dtype bfloat16 on CPU, every expert projection is stored so like
the dense ones (not silently left float32), each decoding close to the expert's own weight,
and the grouped expert GEMM runs on them."""

from __future__ import annotations

import pytest
from model_factory import make_tiny_family
from moe_factory import MOE_FAMILIES

from loraserve import LLM, SamplingParams
from loraserve.model.projections import weight_format


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    model_type, fields = MOE_FAMILIES["olmoe"]
    # the quantized kernel takes inputs in multiples of 64: experts of 64 are quantized
    return make_tiny_family(tmp_path_factory.mktemp("moe-q") / "base", model_type,
                            **{**fields, "intermediate_size": 64})


@pytest.mark.parametrize("scheme,tolerance", [("int8", 0.01), ("int4", 0.15),
                                              ("bfloat16", 0.01)])
def test_expert_projections_are_quantized(olmoe, scheme, tolerance):
    exact = LLM(str(olmoe), enable_prefix_caching=False).engine.model.layers
    how = {"dtype": scheme} if scheme == "bfloat16" else {"quantization": scheme}
    llm = LLM(str(olmoe), enable_prefix_caching=False, **how)
    [out] = llm.generate([[5, 9, 13, 200, 17, 3, 44]], SamplingParams(max_tokens=6, ignore_eos=True,
                                                                       temperature=0))
    assert out.error is None and len(out.token_ids) == 6  # the grouped GEMM, quantized
    layers = llm.engine.model.layers
    for layer, ref in zip(layers, exact, strict=True):
        pairs = list(zip((*layer.moe.gate_up, *layer.moe.down),
                         (*ref.moe.gate_up, *ref.moe.down), strict=True))
        assert {weight_format(q) for q, _ in pairs} == {scheme}
        for q, f in pairs:  # each expert's own weight, quantized: the decoded one is close
            err = (q.weight - f.weight).norm() / f.weight.norm()
            assert err < tolerance, err
