"""The mixture-of-experts fields of a Hugging Face config (Qwen2-MoE, Qwen3-MoE, OLMoE,
Mixtral), as transformers' modeling code computes them, or a one-line ValueError naming the
field we do not compute.

All four route alike (transformers' *TopKRouter): softmax over every expert's logit in
float32, the top k, renormalised to sum 1 where `norm_topk_prob` says so (Mixtral always: a
softmax over its top-k logits is the same thing), cast back to the model's dtype (Mixtral
weights its experts' outputs in float32). Qwen2-MoE
adds its shared expert, a dense MLP gated per token by sigmoid(x @ w). Training-only fields
(router_aux_loss_coef, output_router_logits, router_jitter_noise) do not change inference.
"""

from __future__ import annotations


def _count(c: dict, key: str, where: str) -> int:
    v = c.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{where}: {key} must be a positive integer, got {v!r}")
    return v


def moe_fields(c: dict, where: str, *, experts_key: str, inter_key: str,
               always_norm: bool = False, shared: bool = False) -> dict:
    """ModelConfig's expert fields. Every layer must be sparse: Qwen's mlp_only_layers and
    decoder_sparse_step (dense MLPs on some layers) are refused, not approximated."""
    if experts_key not in c:  # transformers' attribute_map may rename it (Qwen3-MoE)
        experts_key = next((k for k in ("num_experts", "num_local_experts") if k in c),
                           experts_key)
    experts = _count(c, experts_key, where)
    top_k = _count(c, "num_experts_per_tok", where)
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok {top_k} exceeds {experts_key} {experts}")
    if c.get("mlp_only_layers"):
        raise ValueError(f"{where}: mlp_only_layers {c['mlp_only_layers']!r} is not supported "
                         "(dense MLP layers between the expert layers)")
    if c.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{where}: decoder_sparse_step {c['decoder_sparse_step']!r} is not "
                         "supported (only 1: experts in every layer)")
    out = dict(num_experts=experts, num_experts_per_tok=top_k,
               moe_intermediate_size=_count(c, inter_key, where),
               norm_topk_prob=always_norm or bool(c.get("norm_topk_prob")))
    if shared:  # the dense MLP of our layers is the shared expert
        out.update(shared_expert=True,
                   intermediate_size=_count(c, "shared_expert_intermediate_size", where))
    else:  # no dense MLP; its size field names the experts' (num_params, activations)
        out.update(intermediate_size=out["moe_intermediate_size"])
    return out


def olmoe_checks(c: dict, where: str) -> None:
    if c.get("clip_qkv") is not None:
        raise ValueError(f"{where}: clip_qkv {c['clip_qkv']!r} is not supported")
