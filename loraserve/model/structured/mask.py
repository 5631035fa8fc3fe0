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
import torch


@dataclass
class PendingMask:
    rows: list[int]  # the batch rows it constrains
    bitmask: torch.Tensor  # [len(rows), ceil(V / 32)] int32, bit t of a row: token t allowed
    filled: Future

    def bias(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[len(rows), vocab_size] float32: 0 where a token is allowed, -inf elsewhere.
        Each mask byte looks up its 8 tokens' biases: no branch per token (a masked_fill over
        a scattered mask costs several times more on a CPU)."""
        self.filled.result()
        # bytes of a little-endian int32 in memory order: their bits in token order
        octets = self.bitmask.view(torch.uint8).to(device, non_blocking=True).int()
        bias = torch.nn.functional.embedding(octets, _byte_bias(device))
        return bias.view(len(self.rows), -1)[:, :vocab_size]

    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[len(rows), vocab_size] bool: the tokens each constrained row may sample."""
        return self.bias(vocab_size, device) == 0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] with the disallowed tokens of the constrained rows at -inf (a new
        tensor: the caller's is left as it was)."""
        bias = self.bias(logits.shape[-1], logits.device).to(logits.dtype)
        if len(self.rows) == logits.shape[0]:
            return logits + bias
        idx = torch.tensor(self.rows, device=logits.device)
        return logits.index_add(0, idx, bias)


_BYTE_BIAS: dict[torch.device, torch.Tensor] = {}


def _byte_bias(device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, its 8 bits (low first) as 0 (set) or -inf (clear)."""
    table = _BYTE_BIAS.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.zeros(256, 8).masked_fill(bits == 0, float("-inf")).to(device)
        _BYTE_BIAS[device] = table
    return table


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
        filled = self._thread.submit(_fill, self._executor, pairs, bitmask)
        return PendingMask(rows, bitmask, filled)


def _fill(executor: llguidance.LLExecutor, pairs: list, bitmask: torch.Tensor) -> None:
    # Holds `bitmask` (and the matchers) until the native fill is done writing, whatever
    # becomes of the PendingMask meanwhile (a failed forward pass drops it).
    executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4,
                                     bitmask.shape[0])

