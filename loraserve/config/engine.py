"""The engine's knobs (EngineConfig), and how their automatic choices are settled for a
device (`EngineConfig.resolve`) before the engine is wired."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from loraserve.config.knobs import knob

if TYPE_CHECKING:
    import torch

log = logging.getLogger("loraserve.config")

# lora_dtype -> torch dtype name (resolved lazily: `loraserve --help` must not import torch)
LORA_DTYPES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16"}
# lora/backends/ (kept here so config needs no torch)
LORA_BACKEND_NAMES = ("cpu", "torch", "triton")
CPU_DECODE_PACE = 3.0  # decode_pace_factor's default on a CPU (none on a GPU)
LORA_BACKEND_ENV = "LORASERVE_LORA_BACKEND"  # the CPU's LoRA backend when none is named
ATTENTION_BACKEND_NAMES = ("cpu", "triton")  # model/attention/
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "int4", "gguf")  # model/projections.py


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs; names follow SGLang/vLLM. The only place their defaults live: the
    CLI's engine flags are generated from these fields (cli.py)."""

    device: str | None = knob(
        None, "cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)")
    dtype: str = knob(
        "auto", "weights, activations and KV cache: auto = float32 on CPU, bfloat16 on a GPU; "
                "on CPU, bfloat16 is the projections' weights only (bf16 matmul with float32 "
                "sums; activations, KV cache and adapters stay float32), refused where the "
                "CPU computes bf16 slowly; float16 needs a GPU", MODEL_DTYPES)
    quantization: str = knob(
        "none", "base weights on CPU: none (float32); int8 (per output channel) or int4 (per "
                "block of 32, GGUF Q4_0's layout), quantized at load (lm_head int8); gguf: a "
                ".gguf model's own Q8_0/Q4_0/Q4_1/Q4_K tensors as the file holds them. "
                "Adapters stay exact in their own precision", QUANTIZATIONS)
    max_loras_per_batch: int = knob(
        8, "distinct adapters in one batch (the base model counts as one); also the number "
           "of LoRA slots in compute memory. Not binding with one adapter memory "
           "(--lora-memory unified, the CPU default): every host-resident adapter has its slot")
    max_loaded_loras: int | None = knob(
        None, "adapters kept in host memory, LRU beyond (default: unbounded)")
    max_lora_rank: int = knob(64, "largest adapter rank accepted; sizes the slots")
    lora_dtype: str = knob(
        "auto", "adapter weights in compute memory: auto = the model's activations' (float32 "
                "on CPU); bfloat16 "
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
    max_adapter_versions: int = knob(
        2, "live versions of one adapter name (name@N) beyond which old versions retire, "
           "each once no request holds it")
    lora_backend: str | None = knob(
        None, "LoRA op backend: cpu (C kernel), torch, or triton (GPU); default: "
              "$LORASERVE_LORA_BACKEND, else cpu", LORA_BACKEND_NAMES)
    attention_backend: str | None = knob(
        None, "attention backend: cpu (C paged decode and prefill attention; SDPA where they "
              "do not apply) or triton (GPU); default: the device's (cpu on a CPU)",
        ATTENTION_BACKEND_NAMES)
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
        128, "on a GPU, the largest decode batch replayed from a CUDA graph (larger: eager)")
    decode_steps_per_call: int = knob(
        8, "on a CPU, when every running request is a greedy decode (base model, or plain "
           "LoRA over quantized weights) and nothing waits, run up to this many decode steps "
           "in one call into the native decode loop (the token picked inside it; the same "
           "tokens as one step a call), each call kept to about 20 ms; 1: one step a call")
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
    decode_pace_factor: float | None = knob(
        None, "prefill tokens per step are capped so that a step takes at most this many times "
              "a decode-only step (costs measured as the engine runs): long prompts are "
              "chunked so that decodes and short requests keep their pace; 0: no cap (a step "
              "may take max_num_batched_tokens). Default: 3 on a CPU, 0 on a GPU, where a "
              "step's fixed cost dwarfs a chunk's and decode steps replayed from graphs cost "
              "a fraction of any eager step, so a cap only cuts prompts into slivers")
    pace_calibration: bool = knob(
        True, "before serving, time decode-only steps at batch sizes 1, 2, 4, ... up to "
              "max_num_seqs, so the decode pace factor judges the first burst by a measured "
              "step of its size (about a second on a small CPU)",
        off_flag="--disable-pace-calibration")
    tenant_pace_factor: float = knob(
        1.5, "fair scheduling, several clients: steps take on average at most this many times "
             "a step of only the decodes of the clients within their share of seats; prefill "
             "and the decodes of clients above their share fill the rest, least served client "
             "first. 0: no such bound (the decode pace factor alone)")
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
        if self.max_adapter_versions < 1:
            raise ValueError("max_adapter_versions must be >= 1")
        if self.max_loaded_loras is not None and self.max_loaded_loras < 1:
            raise ValueError("max_loaded_loras must be >= 1 or None")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        if self.lora_dtype not in LORA_DTYPES and self.lora_dtype != self.dtype:
            raise ValueError(f"lora_dtype must be one of {sorted(LORA_DTYPES)}, "
                             f"got {self.lora_dtype!r}")
        if (self.attention_backend is not None
                and self.attention_backend not in ATTENTION_BACKEND_NAMES):
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKEND_NAMES)}"
                             f", got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
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
                     "cuda_graph_max_bs", "decode_steps_per_call"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.decode_pace_factor not in (None, 0.0) and self.decode_pace_factor <= 1.0:
            raise ValueError("decode_pace_factor must be above 1 (or 0: no cap)")
        if self.tenant_pace_factor != 0.0 and self.tenant_pace_factor <= 1.0:
            raise ValueError("tenant_pace_factor must be above 1 (or 0: no bound)")
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
    def decode_pace(self) -> float:
        """The decode pace factor: as given or resolved for the device; a config not resolved
        for one (a scheduler built alone) paces as on a CPU."""
        return CPU_DECODE_PACE if self.decode_pace_factor is None else self.decode_pace_factor

    @property
    def activation_dtype(self) -> str:
        """What the model computes in and the KV cache holds: the weights' dtype, except on CPU
        where bfloat16 applies to the projections' weights only (model/bf16_linear.py)."""
        return "float32" if self.device == "cpu" else self.dtype

    @property
    def lora_torch_dtype(self):
        """The slot pool's torch dtype ("auto" reads as float32: `resolve` makes it the
        model's)."""
        import torch

        return getattr(torch, LORA_DTYPES.get(self.lora_dtype, self.lora_dtype))

    def resolve(self, device: str | torch.device | None = None) -> EngineConfig:
        """This config with every automatic choice made for the device the engine runs on
        (`device`, else this config's, else cuda when torch sees a GPU, else cpu): dtype,
        adapter memory, LoRA dtype, both backends and the CUDA graphs, so that nothing is
        "auto" or left to a default any more. What the device cannot run is a ValueError
        here, before anything is built. (What depends on the model, the context length and
        the KV cache size, is settled when the model is read.)"""
        dev = _device_name(device or self.device)
        cpu = dev == "cpu"  # on anything else, a CUDA GPU
        dtype = ("float32" if cpu else "bfloat16") if self.dtype == "auto" else self.dtype
        if cpu and dtype == "float16":
            raise ValueError("dtype float16 needs a GPU: on CPU loraserve computes in float32, "
                             "or with bfloat16 weights (--dtype bfloat16)")
        if self.quantization != "none" and not cpu:
            raise ValueError(f"quantization {self.quantization} runs on CPU only: on a GPU "
                             "loraserve computes in bfloat16 or float16")
        if self.quantization != "none" and dtype != "float32":
            raise ValueError(f"quantization {self.quantization} with dtype {dtype}: the "
                             "quantized weights stand for float32 ones; choose one of the two")
        lora_backend = self.lora_backend or ("triton" if not cpu else (
            os.environ.get(LORA_BACKEND_ENV) or "cpu").lower())
        if lora_backend not in LORA_BACKEND_NAMES:
            raise ValueError(f"${LORA_BACKEND_ENV}={lora_backend!r}: choose from "
                             f"{list(LORA_BACKEND_NAMES)}")
        attention_backend = self.attention_backend or ("cpu" if cpu else "triton")
        graphs = not (cpu or self.disable_cuda_graph)
        if graphs and (lora_backend, attention_backend) != ("triton", "triton"):
            log.warning("decode steps run eagerly: CUDA graphs need the triton LoRA and "
                        "attention backends, not %s and %s", lora_backend, attention_backend)
            graphs = False
        return replace(
            self, device=dev, dtype=dtype,
            lora_dtype=(("float32" if cpu else dtype) if self.lora_dtype == "auto"
                        else self.lora_dtype),
            lora_memory=("unified" if cpu else "tiered") if self.lora_memory == "auto"
            else self.lora_memory,
            lora_backend=lora_backend, attention_backend=attention_backend,
            disable_cuda_graph=not graphs,
            cuda_graph_max_bs=min(self.cuda_graph_max_bs, self.max_num_seqs),
            decode_pace_factor=((CPU_DECODE_PACE if cpu else 0.0)
                                if self.decode_pace_factor is None
                                else self.decode_pace_factor))


def _device_name(device: str | torch.device | None) -> str:
    """The device as torch names it ("cpu", "cuda", "cuda:1"); one this machine cannot run
    is refused."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r}: {e}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: loraserve runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU here")
    return "cpu" if dev.type == "cpu" else str(dev)

