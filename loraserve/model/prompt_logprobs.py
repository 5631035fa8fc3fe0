"""Logprobs of given tokens at given positions: prompt scoring (`prompt_logprobs`).

The values are the model's own distribution (log-softmax of the raw logits, before any
penalty, bias or temperature), as vLLM reports them and as a trainer computes them.
"""

from __future__ import annotations

import torch

from loraserve.types import PromptLogprob


def score_tokens(logits: torch.Tensor, targets: list[int], top_k: list[int]) -> list[PromptLogprob]:
    """logits: [R, V] at R positions; targets: the token that follows each position; top_k:
    per row, how many of the most likely tokens to report besides the target."""
    logp = logits.float().log_softmax(dim=-1)  # [R, V]
    idx = torch.tensor(targets, dtype=torch.long, device=logits.device)
    chosen = logp.gather(1, idx.unsqueeze(1)).squeeze(1)  # [R]
    # rank 1 = the most likely; ties count in the target's favour, as a sort would place it
    ranks = (logp > chosen.unsqueeze(1)).sum(dim=1) + 1
    k_max = max(top_k, default=0)
    top_vals = top_idx = None
    if k_max:
        top_vals, top_idx = torch.topk(logp, k_max, dim=-1)
        top_vals, top_idx = top_vals.tolist(), top_idx.tolist()
    out = []
    for i, (lp, rank) in enumerate(zip(chosen.tolist(), ranks.tolist(), strict=True)):
        top = ()
        if top_k[i]:
            top = tuple(zip(top_idx[i][: top_k[i]], top_vals[i][: top_k[i]], strict=True))
        out.append(PromptLogprob(lp, rank, top))
    return out
