"""The base model's shape and computation: what every layer above reads of a checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The LoRA-targetable linear modules of a Llama-family decoder layer, in HF naming.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTN_MODULES + MLP_MODULES


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are derived from `rope_theta` (HF's `rope_parameters`); the
    tables are built in model/rope.py. Only the types computed exactly are representable."""

    rope_type: str = "default"  # default | linear | dynamic | llama3 | yarn | longrope
    factor: float = 1.0  # linear, dynamic, llama3, yarn
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    attention_factor: float = 1.0  # cos and sin are multiplied by it (yarn, longrope)
    # longrope: per-pair divisors of the frequencies; only its short factors are served, so
    # the context is capped at original_max_position_embeddings (families.py)
    short_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """The shape and the computation of a Llama-family decoder. Which HF families map onto it,
    and how, is decided in one place: loraserve/model/families.py."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    architecture: str = "LlamaForCausalLM"
    rope_scaling: RopeScaling = RopeScaling()
    qkv_bias: bool = False  # q_proj/k_proj/v_proj carry biases (Qwen2; Llama attention_bias)
    o_bias: bool = False  # o_proj carries a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # gate/up/down carry biases (Llama mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    nope_layers: tuple[int, ...] = ()  # layers that skip RoPE (SmolLM3's NoPE layers)
    # per layer: the sliding window (0 = the whole context); () = no window anywhere
    layer_windows: tuple[int, ...] = ()
    # layers whose RoPE uses local_rope_theta with default rope (Gemma 3's sliding layers)
    local_rope_layers: tuple[int, ...] = ()
    local_rope_theta: float = 10000.0
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh
    norm_offset: float = 0.0  # RMSNorms scale by (offset + weight) (Gemma: 1); folded at load
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite's multiplier)
    attn_scale: float | None = None  # scores' scale; None = head_dim ** -0.5
    attn_softcap: float = 0.0  # scores capped by softcap * tanh(s / softcap) (Gemma 2)
    final_softcap: float = 0.0  # logits capped the same way (Gemma 2)
    residual_multiplier: float = 1.0  # each block's output times this before the residual add
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    pre_norms: bool = True  # RMSNorm before attention and before the MLP (all but OLMo 2)
    # RMSNorms on the attention and MLP outputs before each residual add (Gemma 2/3, OLMo 2)
    output_norms: bool = False
    qk_norm_full: bool = False  # RMSNorm over the whole q and k projections (OLMo 2)
    # q/k/v and gate/up are one tensor each in the checkpoint and in PEFT names (Phi-3)
    fused_modules: bool = False
    # Mixture of experts (model/moe.py): 0 experts = a dense MLP in every layer. With experts,
    # every layer routes each token to its top num_experts_per_tok experts; the dense MLP
    # (intermediate_size) stays only as a shared expert gated by a sigmoid (Qwen2-MoE).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    routing_fp32: bool = False  # routing weights stay float32 when weighting outputs (Mixtral)
    shared_expert: bool = False

    @property
    def dense_mlp(self) -> bool:
        """Whether each layer has the gate/up/down MLP (a shared expert counts)."""
        return self.num_experts == 0 or self.shared_expert

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "model", **computation) -> ModelConfig:
        """The shape fields of an HF config.json dict; `computation` sets the fields only a
        family knows (biases, norms, rope scaling) and may override shape fields it reads
        differently (Gemma 3's rope_theta). No checks here: model/families.py refuses what is
        not computed exactly."""
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        fields = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )
        fields.update(computation)
        fields["rope_theta"] = float(fields["rope_theta"])
        return cls(**fields)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        return cls.from_hf_dict(cfg, name=path.name)

    def module_shape(self, module: str) -> tuple[int, int]:
        """(d_out, d_in) of a LoRA-targetable linear, as in nn.Linear.weight."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
            self.intermediate_size,
        )
        shapes = {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
            "qkv_proj": (q + 2 * kv, h),  # fused checkpoints (Phi-3)
            "gate_up_proj": (2 * i, h),
        }
        return shapes[module]

    @property
    def num_params(self) -> int:
        mods = LORA_MODULES if self.dense_mlp else ATTN_MODULES
        per_layer = sum(o * i for o, i in (self.module_shape(m) for m in mods))
        per_layer += 2 * self.hidden_size
        # experts: gate, up and down each, plus the router's row per expert
        per_layer += self.num_experts * (3 * self.moe_intermediate_size + 1) * self.hidden_size
        emb = self.vocab_size * self.hidden_size
        return self.num_hidden_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2)

    @property
    def attention_cost_per_position(self) -> float:
        """What attending to one earlier position costs a token, relative to the token's pass
        through the weights: per layer 2 x heads x head_dim multiply-adds (scores and values)
        against the weights one token multiplies (its routed experts only; lm_head, not the
        embedding lookup). A token at position 4,000 of a 135M model costs about twice one at
        position 0: fair scheduling charges by it."""
        routed_away = (self.num_hidden_layers * (self.num_experts - self.num_experts_per_tok)
                       * 3 * self.moe_intermediate_size * self.hidden_size)
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        per_token = self.num_params - routed_away - lookup
        per_position = (self.num_hidden_layers * 2 * self.num_attention_heads
                        * self.head_dim)
        return per_position / per_token
