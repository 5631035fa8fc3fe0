"""The token mask of a batch's constrained rows: filled off the engine thread while the
forward pass runs, then applied to the logits before sampling.

llguidance fills every constrained row's bitmask in parallel (its own thread pool, without
the GIL); the fill starts before the forward pass and is awaited only when the logits exist,
so its cost hides behind the model's. Unconstrained rows are never touched.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch


@dataclass
class PendingMask:
    rows: list[int]  # the batch rows it constrains
    bitmask: torch.Tensor  # [len(rows), ceil(V / 32)] int32, bit t of a row: token t allowed
    filled: Future

    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[len(rows), vocab_size] bool: the tokens each constrained row may sample."""
        self.filled.result()
        if device.type == "cpu":  # bytes of a little-endian int32 in order: bits in token order
            bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=-1,
                                 bitorder="little")
            return torch.from_numpy(bits[:, :vocab_size]).bool()
        words = self.bitmask.to(device, non_blocking=True)
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        bits = (words.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
        return bits.view(len(self.rows), -1)[:, :vocab_size].bool()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] with the disallowed tokens of the constrained rows at -inf (a
        copy: the caller's tensor is left as it was)."""
        allowed = self.allowed(logits.shape[-1], logits.device)
        idx = torch.tensor(self.rows, device=logits.device)
        out = logits.clone()
        out[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        return out


class GrammarMasker:
    """`vocab_size`: the model's logits width, which the grammars' tokenizer was built with."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None

    def start(self, matchers: list) -> PendingMask | None:
        """Begin filling the masks of the rows whose matcher is not None (row order =
        `matchers` order); None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        # zeros: a row whose fill fails allows nothing and ends (never samples from NaN)
        bitmask = torch.zeros((len(rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
        pairs = [(matchers[r], k) for k, r in enumerate(rows)]
        filled = self._thread.submit(self._executor.unsafe_compute_mask_ptr, pairs,
                                     bitmask.data_ptr(), bitmask.shape[1] * 4, len(rows))
        return PendingMask(rows, bitmask, filled)

