"""Frozen configuration: the base model's shape and the engine's knobs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# The LoRA-targetable linear modules of a Llama-family decoder layer, in HF naming.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTN_MODULES + MLP_MODULES


@dataclass(frozen=True)
class ModelConfig:
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

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "model") -> ModelConfig:
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported yet")
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("attention/MLP biases are not supported (Llama family without bias)")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

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
        }
        return shapes[module]

    @property
    def num_params(self) -> int:
        per_layer = sum(o * i for o, i in (self.module_shape(m) for m in LORA_MODULES))
        per_layer += 2 * self.hidden_size
        emb = self.vocab_size * self.hidden_size
        return self.num_hidden_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2)


LORA_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs; names follow SGLang/vLLM."""

    max_loras_per_batch: int = 8  # distinct adapters per batch (base counts as one) = LoRA slots
    max_loaded_loras: int | None = None  # adapters kept in host memory; None = unbounded
    max_lora_rank: int = 64
    # adapter weights in compute memory: "auto" = the model's dtype (float32 here), or
    # "bfloat16": half the memory and decode traffic, exact for adapters trained in bf16,
    # rounds float32 ones (vLLM's --lora-dtype); LoRA arithmetic stays float32 either way
    lora_dtype: str = "auto"
    max_loras_prefetch: int = 0  # spare slots filled ahead of time from the waiting queue
    allow_pickle_adapters: bool = False
    kv_cache_tokens: int = 32768  # KV pool size in tokens
    block_size: int = 16
    max_num_seqs: int = 128  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    starvation_steps: int = 32  # a waiting request skipped this long blocks newer admissions
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ValueError("max_loras_per_batch must be >= 1")
        if self.max_loaded_loras is not None and self.max_loaded_loras < 1:
            raise ValueError("max_loaded_loras must be >= 1 or None")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {sorted(LORA_DTYPES)}, "
                             f"got {self.lora_dtype!r}")
        if self.max_loras_prefetch < 0:
            raise ValueError("max_loras_prefetch must be >= 0")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")

    @property
    def lora_torch_dtype(self) -> torch.dtype:
        return LORA_DTYPES[self.lora_dtype]

    @property
    def num_lora_slots(self) -> int:
        return self.max_loras_per_batch + self.max_loras_prefetch
