"""Frozen configuration: the base model's shape and the engine's knobs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
        per_layer = sum(o * i for o, i in (self.module_shape(m) for m in LORA_MODULES))
        per_layer += 2 * self.hidden_size
        emb = self.vocab_size * self.hidden_size
        return self.num_hidden_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2)


# lora_dtype -> torch dtype name (resolved lazily: `loraserve --help` must not import torch)
LORA_DTYPES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16"}
# lora/backends/ (kept here so config needs no torch)
LORA_BACKEND_NAMES = ("cpu", "torch", "triton")
ATTENTION_BACKEND_NAMES = ("cpu", "triton")  # model/attention/
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")


def knob(default, help_text: str, choices=None, off_flag: str | None = None):
    """An engine knob: its default and the help text its generated CLI flag shows. A bool
    that defaults to True is turned off by `off_flag` (e.g. --disable-prefix-cache)."""
    return field(default=default, metadata={"help": help_text, "choices": choices,
                                            "off_flag": off_flag})


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs; names follow SGLang/vLLM. The only place their defaults live: the
    CLI's engine flags are generated from these fields (cli.py)."""

    device: str | None = knob(
        None, "cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)")
    dtype: str = knob(
        "auto", "weights, activations and KV cache: auto = float32 on CPU, bfloat16 on a GPU; "
                "bfloat16 and float16 need a GPU", MODEL_DTYPES)
    max_loras_per_batch: int = knob(
        8, "distinct adapters in one batch (the base model counts as one); also the number "
           "of LoRA slots in compute memory. Not binding with one adapter memory "
           "(--lora-memory unified, the CPU default): every host-resident adapter has its slot")
    max_loaded_loras: int | None = knob(
        None, "adapters kept in host memory, LRU beyond (default: unbounded)")
    max_lora_rank: int = knob(64, "largest adapter rank accepted; sizes the slots")
    lora_dtype: str = knob(
        "auto", "adapter weights in compute memory: auto = the model's (float32); bfloat16 "
                "halves the memory, exact for adapters trained in bf16", tuple(LORA_DTYPES))
    lora_memory: str = knob(
        "auto", "unified: one adapter memory, each adapter packed once when it reaches host "
                "memory and read there by the kernel (max_loaded_loras bounds it); tiered: "
                "host memory, then max_loras_per_batch compute slots filled per batch (for "
                "GPUs); auto: unified on CPU, tiered elsewhere", ("auto", "unified", "tiered"))
    unified_prefetch: bool = knob(
        True, "with one adapter memory: read from disk, ahead of admission, every adapter the "
              "waiting queue needs (within max_loaded_loras); off, only the next one",
        off_flag="--disable-unified-prefetch")
    max_loras_prefetch: int = knob(
        0, "spare slots filled ahead of time from the waiting queue")
    lora_backend: str | None = knob(
        None, "LoRA op backend: cpu (C kernel), torch, or triton (GPU); default: "
              "$LORASERVE_LORA_BACKEND, else cpu", LORA_BACKEND_NAMES)
    attention_backend: str | None = knob(
        None, "attention backend: cpu (C paged decode + SDPA) or triton (GPU); default: the "
              "device's (cpu on a CPU)", ATTENTION_BACKEND_NAMES)
    allow_pickle_adapters: bool = knob(
        False, "also read adapter_model.bin (pickle: can run code from the file)")
    kv_cache_tokens: int | None = knob(
        None, "KV cache size in tokens (default: kv_cache_memory when given, else 32768 on "
              "CPU and what gpu_memory_utilization leaves on a GPU)")
    kv_cache_memory: int | None = knob(
        None, "KV cache size in bytes, every layer's K and V (instead of kv_cache_tokens)")
    gpu_memory_utilization: float = knob(
        0.9, "on a GPU: the share of its memory for this engine (weights, LoRA slots, one "
             "step's activations, KV cache); the KV cache gets what the rest leave")
    block_size: int = knob(16, "tokens per KV cache block")
    max_num_seqs: int = knob(128, "sequences in one step")
    max_num_batched_tokens: int = knob(
        2048, "tokens in one step (prefill chunks + decodes)")
    enable_prefix_caching: bool = knob(
        True, "the prefix cache: reuse the K/V of prompt prefixes already computed under the "
              "same weights", off_flag="--disable-prefix-cache")
    disable_cuda_graph: bool = knob(
        False, "on a GPU, run decode steps eagerly instead of replaying recorded CUDA graphs")
    cuda_graph_max_bs: int = knob(
        32, "on a GPU, the largest decode batch replayed from a CUDA graph (larger: eager)")
    max_model_len: int | None = knob(
        None, "context length (default: the model's max_position_embeddings)")
    starvation_steps: int = knob(
        32, "steps a request refused by the adapter cap may wait before nothing newer is "
            "admitted ahead of it")
    request_fair_share: float = knob(
        0.5, "while other clients' requests wait, the largest share of max_num_seqs and of the "
             "KV cache that one client (with --disable-fair-scheduling: one client request, "
             "its n x prompts) may hold in the running batch")
    fair_scheduling: bool = knob(
        True, "share the engine between clients (API key tenant, else address) by tokens "
              "served (virtual token counters): new requests and the next chunks of long "
              "prompts go to the client served least; within a client, to the request served "
              "least. Off: first come, first served",
        off_flag="--disable-fair-scheduling")
    fair_decode_weight: float = knob(
        2.0, "fair scheduling: what a decode token counts in a client's service, a prefill "
             "token counting 1")
    decode_pace_factor: float = knob(
        3.0, "prefill tokens per step are capped so that a step takes at most this many times "
             "a decode-only step (costs measured as the engine runs): long prompts are chunked "
             "so that decodes and short requests keep their pace; 0: no cap (a step may take "
             "max_num_batched_tokens)")
    max_unread_outputs: int = knob(
        64, "outputs a streaming request may have waiting unread by its client; beyond, it "
            "leaves the running batch (its seat and KV freed) until the client reads; 0: "
            "unbounded")
    stalled_stream_timeout: float = knob(
        60.0, "seconds a request paused for an unread stream waits for its client before it "
              "is aborted")
    num_threads: int | None = knob(
        None, "torch intra-op threads (default: torch's choice)")
    seed: int = knob(0, "seed of the sampling RNG of requests that bring no seed of their own")

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
        if (self.attention_backend is not None
                and self.attention_backend not in ATTENTION_BACKEND_NAMES):
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKEND_NAMES)}"
                             f", got {self.attention_backend!r}")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {list(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.lora_backend is not None and self.lora_backend not in LORA_BACKEND_NAMES:
            raise ValueError(f"lora_backend must be one of {list(LORA_BACKEND_NAMES)}, "
                             f"got {self.lora_backend!r}")
        if self.max_loras_prefetch < 0:
            raise ValueError("max_loras_prefetch must be >= 0")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")
        if self.kv_cache_tokens is not None and self.kv_cache_memory is not None:
            raise ValueError("give kv_cache_tokens or kv_cache_memory, not both")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        for name in ("max_num_seqs", "max_num_batched_tokens", "starvation_steps",
                     "cuda_graph_max_bs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.decode_pace_factor != 0.0 and self.decode_pace_factor <= 1.0:
            raise ValueError("decode_pace_factor must be above 1 (or 0: no cap)")
        if self.fair_decode_weight < 0.0:
            raise ValueError("fair_decode_weight must be >= 0")
        if self.max_unread_outputs < 0:
            raise ValueError("max_unread_outputs must be >= 0")
        if self.stalled_stream_timeout <= 0.0:
            raise ValueError("stalled_stream_timeout must be > 0")
        if not 0.0 < self.request_fair_share <= 1.0:
            raise ValueError("request_fair_share must be in (0, 1]")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")

    @property
    def lora_torch_dtype(self):
        """The slot pool's dtype when lora_dtype is not auto (auto: the model's)."""
        import torch

        return getattr(torch, LORA_DTYPES[self.lora_dtype])

    @property
    def num_lora_slots(self) -> int:
        return self.max_loras_per_batch + self.max_loras_prefetch


ROUTING_POLICIES = ("affinity", "round_robin")  # cluster/routing.py


@dataclass(frozen=True)
class ClusterConfig:
    """Scale-out over Ray Serve (loraserve/cluster/). With replicas=1 and no ray_address,
    `serve` runs the single server and never imports ray."""

    replicas: int = knob(
        1, "engine replicas behind one ingress (Ray Serve, `pip install loraserve[cluster]`); "
           "above 1 a local Ray instance is started unless --ray-address is given")
    ray_address: str | None = knob(
        None, "join this Ray cluster (e.g. auto or HEAD_IP:6379) instead of starting one")
    routing: str = knob(
        "affinity", "affinity: an adapter's requests go to a replica that holds it (Ray Serve "
                    "multiplexing), else the least loaded; round_robin: in turn",
        ROUTING_POLICIES)
    replica_cpus: float = knob(
        1.0, "Ray CPUs each engine replica reserves (its torch threads unless --num-threads)")

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {list(ROUTING_POLICIES)}, "
                             f"got {self.routing!r}")
        if self.replica_cpus <= 0:
            raise ValueError("replica_cpus must be > 0")

    @property
    def enabled(self) -> bool:
        return self.replicas > 1 or self.ray_address is not None
