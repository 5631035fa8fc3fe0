"""How many tokens the KV cache holds, decided once at start.

Precedence: `kv_cache_tokens` when given; else `kv_cache_memory` (bytes, every layer's K and V);
else, on a GPU, what `gpu_memory_utilization` of its memory leaves once the weights and the
LoRA slot pool (already allocated when this runs) and a bound on one step's activations are
counted, as vLLM sizes its cache; on CPU, DEFAULT_CPU_TOKENS. A budget that holds less than
one block, or a GPU share larger than the memory that is free, is a ValueError that says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraserve.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)
DEFAULT_CPU_TOKENS = 32768
GIB = 1 << 30


@dataclass(frozen=True)
class GpuMemory:
    """What the device says now, in bytes (torch.cuda.mem_get_info and the caching allocator)."""

    free: int
    total: int
    allocated: int  # by this process's tensors: weights, LoRA slots
    reserved: int  # held by this process's caching allocator (>= allocated)


def probe_gpu(device: torch.device) -> GpuMemory:
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(free, total, torch.cuda.memory_allocated(device),
                     torch.cuda.memory_reserved(device))


@dataclass(frozen=True)
class KvSizing:
    tokens: int
    bytes_per_token: int
    source: str  # which knob decided it

    @property
    def nbytes(self) -> int:
        return self.tokens * self.bytes_per_token


def kv_bytes_per_token(mc: ModelConfig, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * itemsize


def step_activation_bytes(mc: ModelConfig, c: EngineConfig, dtype: torch.dtype) -> int:
    """A bound on one step's transient tensors: a layer's widest outputs for every batched
    token (fused qkv, gate_up and the product after it, attention output, two residual-width
    tensors, and the routed experts' rows), twice over for the allocator's slack, plus float32
    logits for every sequence."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    width = (q + 2 * kv) + 3 * mc.intermediate_size + q + 2 * mc.hidden_size
    # experts: each token's top-k rows (input, gate_up and product, output) and the router's
    width += mc.num_experts_per_tok * (2 * mc.hidden_size + 3 * mc.moe_intermediate_size)
    width += 2 * mc.num_experts
    return 2 * c.max_num_batched_tokens * width * itemsize + c.max_num_seqs * mc.vocab_size * 4


def size_kv_cache(c: EngineConfig, mc: ModelConfig, device: torch.device, dtype: torch.dtype,
                  probe: Callable[[torch.device], GpuMemory] = probe_gpu) -> KvSizing:
    per_token = kv_bytes_per_token(mc, dtype)
    if c.kv_cache_tokens is not None:
        tokens, source = c.kv_cache_tokens, "kv_cache_tokens"
    elif c.kv_cache_memory is not None:
        tokens, source = c.kv_cache_memory // per_token, f"kv_cache_memory={c.kv_cache_memory}"
    elif device.type == "cuda":
        tokens, source = _from_gpu_share(c, mc, device, dtype, per_token, probe)
    else:
        tokens, source = DEFAULT_CPU_TOKENS, "the CPU default"
    tokens = tokens // c.block_size * c.block_size
    if tokens < c.block_size:
        raise ValueError(f"{source} leaves the KV cache {tokens} tokens: one block needs "
                         f"{c.block_size} tokens ({c.block_size * per_token} bytes at "
                         f"{per_token} bytes a token)")
    sizing = KvSizing(tokens, per_token, source)
    log.info("KV cache: %d tokens, %.2f GiB (%s)", tokens, sizing.nbytes / GIB, source)
    return sizing


def _from_gpu_share(c: EngineConfig, mc: ModelConfig, device: torch.device,
                    dtype: torch.dtype, per_token: int,
                    probe: Callable[[torch.device], GpuMemory]) -> tuple[int, str]:
    m = probe(device)
    share = c.gpu_memory_utilization * m.total
    others = m.total - m.free - m.reserved  # other processes on the same GPU
    if share > m.total - others:
        raise ValueError(
            f"gpu_memory_utilization={c.gpu_memory_utilization} asks for {share / GIB:.2f} "
            f"GiB of {m.total / GIB:.2f} GiB, but other processes hold {others / GIB:.2f} "
            "GiB: lower it, or give kv_cache_memory / kv_cache_tokens")
    budget = share - m.allocated - step_activation_bytes(mc, c, dtype)
    source = (f"gpu_memory_utilization={c.gpu_memory_utilization}: {budget / GIB:.2f} GiB "
              f"after {m.allocated / GIB:.2f} GiB of weights and LoRA slots")
    return max(int(budget), 0) // per_token, source
