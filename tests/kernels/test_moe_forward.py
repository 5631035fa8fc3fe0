"""The grouped expert GEMM (model/moe.py) against transformers' own router and experts modules
of each family, in float32 and bfloat16, on token counts from one to more than the experts'
rows (experts with no row, with one, with many)."""

from __future__ import annotations

import pytest
import torch

from loraserve.model.linear import Linear
from loraserve.model.moe import MoeWeights, moe_forward, route
from loraserve.ops.elementwise import silu_mul

FAMILIES = {  # model_type -> (its modeling module's prefix, config fields)
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=8, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=16, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=8, moe_intermediate_size=24,
                                   norm_topk_prob=True)),
    "olmoe": ("Olmoe", dict(num_experts=8, intermediate_size=24)),
    "mixtral": ("Mixtral", dict(num_local_experts=8, intermediate_size=24)),
}


def _hf_block(model_type: str, dtype: torch.dtype):
    import importlib

    from transformers import AutoConfig

    prefix, fields = FAMILIES[model_type]
    cfg = AutoConfig.for_model(model_type, hidden_size=32, num_experts_per_tok=2,
                               num_attention_heads=4, num_hidden_layers=1, **fields)
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(0)
    router = getattr(mod, f"{prefix}TopKRouter")(cfg)
    experts = getattr(mod, f"{prefix}Experts")(cfg)
    with torch.no_grad():
        for p in (*router.parameters(), *experts.parameters()):
            p.copy_(torch.randn(p.shape) * 0.3)
    return cfg, router.to(dtype).eval(), experts.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_grouped_experts_equal_transformers(model_type, tokens, dtype):
    cfg, router, experts = _hf_block(model_type, dtype)
    w = MoeWeights(router=router.weight.detach(),
                   gate_up=[Linear(t) for t in experts.gate_up_proj.detach()],
                   down=[Linear(t) for t in experts.down_proj.detach()],
                   top_k=2, norm_topk=model_type == "mixtral" or bool(cfg.norm_topk_prob),
                   routing_fp32=model_type == "mixtral")
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.inference_mode():
        _, hf_weights, hf_experts = router(x)
        want = experts(x, hf_experts, hf_weights)
        weights, chosen = route(x, w)
        got = moe_forward(x, w, silu_mul, 0, None)
    assert torch.equal(chosen, hf_experts)
    assert weights.dtype == hf_weights.dtype
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
    torch.testing.assert_close(got, want)


def test_expert_runs_cover_each_segments_rows_in_every_expert():
    from loraserve.lora.expert_lora import expert_runs

    g = torch.Generator().manual_seed(0)
    tokens, k, num_experts = 23, 3, 6
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    token_of_row = order // k
    bounds = [0, *torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).tolist()]
    a, b = object(), object()  # two adapters' segments; tokens 5-9 and 20-22 are base rows
    segments = [(0, 5, a), (10, 20, b), (20, 23, a)]
    runs = expert_runs(segments, token_of_row, bounds)
    owner = {}
    for t0, t1, who in segments:
        owner.update(dict.fromkeys(range(t0, t1), who))
    for e in range(num_experts):
        covered = {}
        for r0, r1, who in runs[e]:
            assert bounds[e] <= r0 < r1 <= bounds[e + 1]
            covered.update(dict.fromkeys(range(r0, r1), who))
        for r in range(bounds[e], bounds[e + 1]):
            assert int(flat[order[r]]) == e
            assert covered.get(r) is owner.get(int(token_of_row[r])), (e, r)
