"""The attention backend interface: paged K/V writes and reads, metadata built per step.

The cache of one layer is a pair of flat tensors of token slots `[num_blocks * block_size,
kv_heads, head_dim]`; a sequence's K/V live in the blocks its block table names. A backend
turns the step's sequences into whatever index tensors it needs (`prepare`, once per step,
reused by every layer), then per layer writes the new tokens' K/V into their slots and
attends: each new token sees its sequence's context (cached tokens and earlier new tokens of
the same sequence, causally) and nothing of any other sequence.

Two per-layer values change what is seen and how (transformers' semantics, exactly): with
`window` > 0 the token at position p sees only positions > p - window (sliding-window layers
of Mistral, Qwen2/3, Gemma 2/3); with `softcap` > 0 each scaled score s becomes softcap *
tanh(s / softcap) before the softmax (Gemma 2). The KV of every position is kept either way,
so a cached prefix stays valid.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch


class AttentionSeq(NamedTuple):
    """One sequence of the flat step batch, as the attention backend needs it."""

    start: int  # its first row in the flat batch; its rows are [start, start + num_new)
    num_new: int  # tokens it feeds this step (1 = decode)
    num_computed: int  # tokens already in its KV blocks before this step
    block_table: list[int]  # its KV blocks, enough for num_computed + num_new tokens
    # tokens of a prompt longer than one token, however few this step: attended as prompts
    # are, never as a decode, so where the scheduler ended a chunk changes no bit
    prompt_chunk: bool = False


class AttentionBackend(ABC):
    def __init__(self, block_size: int, device: torch.device | str):
        self.block_size = block_size
        self.device = torch.device(device)

    @abstractmethod
    def prepare(self, seqs: Sequence[AttentionSeq]) -> Any:
        """This step's metadata, built once and passed to every layer's `forward`."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, nh, hd]
        k: torch.Tensor,  # [T, kvh, hd] this step's keys (rope applied)
        v: torch.Tensor,  # [T, kvh, hd]
        k_cache: torch.Tensor,  # [S, kvh, hd] this layer's cache, written in place
        v_cache: torch.Tensor,
        meta: Any,
        scale: float,
        window: int = 0,  # 0: all of the context
        softcap: float = 0.0,  # 0: scores uncapped
    ) -> torch.Tensor:  # [T, nh, hd]
        """Store k/v in the new tokens' slots, then attend as the module docstring says."""
