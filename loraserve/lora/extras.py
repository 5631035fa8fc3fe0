"""An adapter's parts beyond the packed low-rank deltas, and how they act on its rows.

The packed groups (layout.py) carry `B @ A` only. What PEFT adapters add around them is
small, per output column or per vocabulary row, and is applied here once, in torch, after
whichever backend computed the group's projection, so every backend serves it alike:

- a column epilogue per layer group: `y = y * scale + bias` on the rows of the adapter's
  segments. `scale` is DoRA's `m / ||W + s B A||_c` (computed once when the adapter is read);
  `bias` is `scaling * lora_B.bias` (PEFT's lora_bias). A base bias of the projection is not
  scaled by DoRA, so `(1 - scale) * base_bias` is added back;
- the vocabulary ends (`VocabParts`): LoRA on the embedding lookup and on lm_head, full
  per-adapter copies of either (modules_to_save), and replaced rows (trainable tokens);
- LoRA on the experts of a mixture-of-experts layer (`ExpertLora`, lora/expert_lora.py),
  applied inside the layer's grouped expert GEMM on the adapter's rows.

Base rows and other adapters' rows are never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from loraserve.lora.expert_lora import ExpertLora


@dataclass(frozen=True)
class ColumnEpilogue:
    """One layer group's per-column epilogue for one adapter (None: that part is absent)."""

    scale: torch.Tensor | None = None  # [d_out_g] DoRA's m / ||W + sBA||_c; 1 off DoRA modules
    bias: torch.Tensor | None = None  # [d_out_g] scaling * lora_B.bias; 0 off biased modules

    def apply(self, y: torch.Tensor, base_bias: torch.Tensor | None) -> None:
        """y: [n, d_out_g] the adapter's rows of the projection (base + LoRA), in place."""
        if self.scale is not None:
            y.mul_(self.scale)
            if base_bias is not None:  # PEFT's DoRA scales W x + s B A x, not the base bias
                y.add_(base_bias * (1 - self.scale))
        if self.bias is not None:
            y.add_(self.bias)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.scale, self.bias) if t is not None)


@dataclass(frozen=True)
class VocabParts:
    """One adapter's parts at the embedding lookup and the output layer. Embedding-side tensors
    already carry the model's embedding scale, and LoRA B's the adapter's scaling."""

    embed_lora: tuple[torch.Tensor, torch.Tensor] | None = None  # A.T [V, r], B.T [r, d]
    head_lora: tuple[torch.Tensor, torch.Tensor] | None = None  # A [r, d], B.T [r, V]
    embed_table: torch.Tensor | None = None  # [V, d] modules_to_save copy
    head_table: torch.Tensor | None = None  # [V, d] modules_to_save copy
    embed_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # token ids [k], rows [k, d]
    head_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # token ids [k], rows [k, d]

    @property
    def nbytes(self) -> int:
        total = 0
        for f in fields(self):
            v = getattr(self, f.name)
            for t in (v if isinstance(v, tuple) else (v,)):
                total += t.nbytes if t is not None else 0
        return total

    def to(self, device: torch.device) -> VocabParts:
        def move(v):
            if isinstance(v, tuple):
                return tuple(t.to(device) for t in v)
            return None if v is None else v.to(device)

        return VocabParts(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def embed(self, ids: torch.Tensor, h: torch.Tensor) -> None:
        """h: [n, d] the base embedding of ids [n], made this adapter's, in place."""
        if self.embed_table is not None:
            h.copy_(F.embedding(ids, self.embed_table))
        if self.embed_rows is not None:
            tok, rows = self.embed_rows
            hit = ids.unsqueeze(1) == tok  # [n, k]
            where = hit.any(1)
            if bool(where.any()):
                h[where] = rows[hit[where].int().argmax(1)].to(h.dtype)
        if self.embed_lora is not None:
            a_t, b_t = self.embed_lora
            h.add_(F.embedding(ids, a_t) @ b_t)

    def head(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        """logits: [n, V] the base output layer's of x [n, d], made this adapter's, in place.
        In float32, as the parts are kept (a bf16 model's rows are widened)."""
        x = x.to(torch.float32)
        if self.head_table is not None:
            logits.copy_(F.linear(x, self.head_table))
        if self.head_rows is not None:
            tok, rows = self.head_rows
            logits[:, tok] = F.linear(x, rows).to(logits.dtype)
        if self.head_lora is not None:
            a, b_t = self.head_lora
            logits.add_((x @ a.T) @ b_t)


@dataclass(frozen=True)
class AdapterExtras:
    """Everything of one adapter outside its packed groups, as a slot holds it."""

    epilogues: tuple[dict[str, ColumnEpilogue], ...] = ()  # per layer: group -> epilogue
    vocab: VocabParts | None = None
    experts: tuple[ExpertLora | None, ...] = ()  # per layer; () = no expert LoRA

    @property
    def nbytes(self) -> int:
        n = sum(e.nbytes for per_layer in self.epilogues for e in per_layer.values())
        n += sum(e.nbytes for e in self.experts if e is not None)
        return n + (self.vocab.nbytes if self.vocab is not None else 0)


# (slot, first token, end token, its extras), one per segment of a slot that has any
ExtraSegment = tuple[int, int, int, AdapterExtras]


def apply_epilogues(segments: tuple[ExtraSegment, ...], layer: int, group: str,
                    y: torch.Tensor, linear: Callable) -> None:
    """Each segment's column epilogue of (layer, group) on its rows of y, in place."""
    for _, a, b, ext in segments:
        ep = ext.epilogues[layer].get(group) if ext.epilogues else None
        if ep is not None and b > a:
            ep.apply(y[a:b], getattr(linear, "bias", None))


def embed_with_extras(segments: tuple[ExtraSegment, ...], ids: torch.Tensor,
                      table: torch.Tensor) -> torch.Tensor:
    """The embedding of ids [T] ([T, d]), each adapter segment's with its vocabulary parts."""
    h = F.embedding(ids, table)
    for _, a, b, ext in segments:
        if ext.vocab is not None and b > a:
            ext.vocab.embed(ids[a:b], h[a:b])
    return h


def head_with_extras(segments: tuple[ExtraSegment, ...], rows: torch.Tensor, x: torch.Tensor,
                     lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """lm_head(x) [B, V] for x [B, d], the hidden states of token rows `rows` [B] (ascending):
    each adapter segment's rows through its vocabulary parts."""
    logits = lm_head(x)
    vocab = [(a, b, ext.vocab) for _, a, b, ext in segments if ext.vocab is not None]
    if not vocab:
        return logits
    bounds = torch.searchsorted(rows, torch.tensor([v for a, b, _ in vocab for v in (a, b)],
                                                   device=rows.device)).tolist()
    for i, (_, _, parts) in enumerate(vocab):
        r0, r1 = bounds[2 * i], bounds[2 * i + 1]
        if r1 > r0:
            parts.head(x[r0:r1], logits[r0:r1])
    return logits
