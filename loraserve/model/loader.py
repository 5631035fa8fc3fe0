"""Load a Hugging Face checkpoint of a supported family (config.json + safetensors, sharded
too); model/families.py decides whether and how it is computed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from loraserve.model.families import read_model_config
from loraserve.model.llama import LayerWeights, LlamaModel
from loraserve.model.moe import MoeWeights
from loraserve.model.projections import ProjectionBuilder
from loraserve.ops.bf16_gemm import require_fast_bf16


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def read_state_dict(path: Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                tensors[key] = st.get_tensor(key).to(device=device, dtype=dtype)
    return tensors


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", quantization: str = "none",
               gguf_file: Path | None = None,
               weight_dtype: torch.dtype | None = None) -> LlamaModel:
    """The model at `path`, computing in `dtype`; its projections quantized by `quantization`
    (model/projections.py: none, int8, int4, or gguf: the tensors of `gguf_file`, the GGUF the
    checkpoint was converted from). `weight_dtype` bfloat16 with a float32 `dtype` on CPU: the
    projections' weights in bf16 (model/bf16_linear.py), refused where this CPU computes bf16
    slowly (ops/bf16_gemm.py)."""
    path = Path(path)
    config = read_model_config(path)  # refuses what we do not compute exactly, before reading
    bf16_weights = weight_dtype not in (None, dtype)
    if bf16_weights and (weight_dtype != torch.bfloat16 or dtype != torch.float32
                         or torch.device(device).type != "cpu"):
        raise ValueError(f"{weight_dtype} weights under {dtype} activations on {device}: only "
                         "bfloat16 weights with float32 activations on CPU are computed")
    if bf16_weights:
        require_fast_bf16()
    build = ProjectionBuilder(quantization, gguf_file, config.num_attention_heads,
                              config.num_key_value_heads, bf16_weights=bf16_weights)
    sd = read_state_dict(path, dtype, device)

    def take(name: str) -> torch.Tensor:
        try:
            return sd.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint {path} lacks tensor {name!r}") from None

    def linear(names: list[str], bias: bool):
        """The fused projection of `names` (prefixes of .weight/.bias), stacked on d_out."""
        weight = torch.cat([take(n + ".weight") for n in names])
        return build(names, weight, torch.cat([take(n + ".bias") for n in names]) if bias
                     else None)

    c = config

    def norm(name: str) -> torch.Tensor:
        # Gemma's RMSNorm scales by (1 + w): folding the offset in makes it a plain RMSNorm.
        w = take(name)
        return (w + c.norm_offset if c.norm_offset else w).contiguous()

    proj = (["qkv_proj"], ["gate_up_proj"]) if c.fused_modules else (
        ["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"])
    # expert checkpoints name the expert linears (and, for Mixtral, the block) their own way
    moe_block, expert_names = ("block_sparse_moe", ("w1", "w3", "w2")) \
        if c.architecture == "MixtralForCausalLM" else ("mlp", ("gate_proj", "up_proj",
                                                                 "down_proj"))

    def experts(p: str) -> MoeWeights:
        """The layer's experts: per expert gate over up [2 * inter, d], and down [d, inter]."""
        m = p + moe_block + "."
        g, u, d = ([take(f"{m}experts.{e}.{n}.weight") for e in range(c.num_experts)]
                   for n in expert_names)
        gate_up = [build.expert(f"{m}experts.{e}.gate_up", torch.cat(pair))
                   for e, pair in enumerate(zip(g, u, strict=True))]
        down = [build.expert(f"{m}experts.{e}.down", w) for e, w in enumerate(d)]
        return MoeWeights(router=take(m + "gate.weight").contiguous(), gate_up=gate_up,
                          down=down, top_k=c.num_experts_per_tok,
                          norm_topk=c.norm_topk_prob, routing_fp32=c.routing_fp32,
                          shared_gate=take(m + "shared_expert_gate.weight").contiguous()
                          if c.shared_expert else None)
    layers = []
    # a bar in a terminal (packing a large model's projections takes a while), none in logs
    for i in tqdm(range(c.num_hidden_layers), desc="loading weights", unit="layer",
                  disable=None, leave=False):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        m = p + ("mlp.shared_expert." if c.shared_expert else "mlp.")
        qk_norm = qk_full_norm = None
        if c.qk_norm:  # one weight row per head: q heads first, then kv heads (see llama.py)
            qk_norm = torch.cat([norm(a + "q_norm.weight").expand(c.num_attention_heads, -1),
                                 norm(a + "k_norm.weight").expand(c.num_key_value_heads, -1)])
        if c.qk_norm_full:
            qk_full_norm = (norm(a + "q_norm.weight"), norm(a + "k_norm.weight"))
        # Llama names its pre-MLP norm post_attention_layernorm; with output norms (Gemma,
        # OLMo 2) that name is the norm on the attention output, and the pre-MLP one is
        # pre_feedforward_layernorm.
        out_norms = c.output_norms
        pre_mlp = "pre_feedforward_layernorm" if out_norms else "post_attention_layernorm"
        layers.append(
            LayerWeights(
                input_norm=norm(p + "input_layernorm.weight") if c.pre_norms else None,
                qkv=linear([a + n for n in proj[0]], c.qkv_bias),
                o=linear([a + "o_proj"], c.o_bias),
                post_norm=norm(p + pre_mlp + ".weight") if c.pre_norms else None,
                gate_up=linear([m + n for n in proj[1]], c.mlp_bias) if c.dense_mlp else None,
                down=linear([m + "down_proj"], c.mlp_bias) if c.dense_mlp else None,
                qk_norm=qk_norm,
                qk_full_norm=qk_full_norm,
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if out_norms else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if out_norms else None,
                rope=None if i in c.nope_layers else int(i in c.local_rope_layers),
                window=c.layer_windows[i] if c.layer_windows else 0,
                moe=experts(p) if c.num_experts else None,
            )
        )
    embed = take("model.embed_tokens.weight").contiguous()
    if c.tie_word_embeddings or "lm_head.weight" not in sd:
        lm_head = build.head(embed)  # its own packed copy: embedding rows vs GEMM layout
        sd.pop("lm_head.weight", None)
    else:
        lm_head = build.head(take("lm_head.weight"))
    if c.embed_scale != 1.0:  # the lm_head above keeps the unscaled rows
        # times the scale in the weights' dtype, as Gemma does: exactly its scaled lookup
        embed = embed * torch.tensor(c.embed_scale, dtype=embed.dtype)
    final_norm = norm("model.norm.weight")
    leftovers = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ValueError(f"checkpoint {path} has tensors this model does not use: {leftovers[:5]}")
    build.finish()
    return LlamaModel(config, embed, layers, final_norm, lm_head)
