"""Per-request sampling of next-token logits: penalties and biases (logits_processors.py),
the grammar mask of constrained rows (structured/mask.py), then greedy, or temperature, min_p,
top-k, top-p and a seeded draw. A row left with no allowed token is reported dead, never
sampled from NaN."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from loraserve.model.logits_processors import apply_min_p, process_logits
from loraserve.model.structured.mask import PendingMask
from loraserve.types import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # chosen token's logprob per row (None if no row asked)
    top_logprobs: list[dict[int, float] | None] | None
    dead: list[int] = field(default_factory=list)  # rows with no allowed token (token: -1)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [V] already divided by temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (always keeps the first).
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False  # the top token always stays, however small top_p (even 0 in float32)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (NaN counts as the maximum), as torch.argmax. On the CPU
    through numpy: torch's argmax over one vocabulary row took ten times as long, a visible
    part of a batch-1 decode step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().contiguous().numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompts: list[list[int]] | None = None,  # per row: needed by repetition_penalty
    outputs: list[list[int]] | None = None,  # per row: the tokens sampled so far
    eos_token_ids: frozenset[int] = frozenset(),
    mask: PendingMask | None = None,  # the grammar masks of the constrained rows
) -> SampleResult:
    raw = logits  # logprobs are reported from the model's own distribution (vLLM's default)
    if any(p.processes_logits for p in params):
        if prompts is None or outputs is None:
            raise ValueError("penalties and min_tokens need each row's prompt and output")
        logits = process_logits(logits, params, prompts, outputs, eos_token_ids)
    dead: list[int] = []
    if mask is not None:
        logits = mask.apply(logits)
        rows = torch.tensor(mask.rows, device=logits.device)
        none_left = torch.isneginf(logits[rows]).all(dim=-1).tolist()
        dead = [r for r, d in zip(mask.rows, none_left, strict=True) if d]
    greedy = all(p.greedy for p in params)
    if greedy:
        tokens = argmax_rows(logits)
    else:
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        for i, (p, g) in enumerate(zip(params, generators, strict=True)):
            if i in dead:
                tokens[i] = 0
                continue
            if p.greedy:
                tokens[i] = argmax_rows(logits[i])
                continue
            row = apply_min_p(logits[i] / p.temperature, p.min_p)
            row = _filter_top_k_top_p(row, p.top_k, p.top_p)
            probs = row.softmax(-1)
            tokens[i] = torch.multinomial(probs, 1, generator=g)[0]
    token_list = tokens.tolist()
    for i in dead:
        token_list[i] = -1
    if all(p.logprobs is None for p in params):
        return SampleResult(token_list, None, None, dead)
    logp = raw.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    tops: list[dict[int, float] | None] = []
    for i, p in enumerate(params):
        if not p.logprobs:
            tops.append(None)
            continue
        vals, idx = torch.topk(logp[i], p.logprobs)
        tops.append(dict(zip(idx.tolist(), vals.tolist(), strict=True)))
    return SampleResult(token_list, chosen, tops, dead)
