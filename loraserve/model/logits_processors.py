"""Per-request logits processing before sampling, with vLLM's semantics and order.

On the raw logits of each row that asks for it, in this order:
1. `logit_bias`: the bias is added to its token's logit (OpenAI).
2. `min_tokens`: while fewer tokens are out, EOS (unless ignore_eos) and the stop ids get -inf.
3. `repetition_penalty` r over prompt + output tokens: a positive logit is divided by r, a
   negative one multiplied (CTRL; same as vLLM and transformers).
4. `frequency_penalty` f and `presence_penalty` p over output tokens only (OpenAI):
   logit -= f * count + p * (count > 0).
Greedy rows take the argmax of the result; the others then apply temperature, min_p, top-k and
top-p (model/sampler.py). Rows that ask for none of this are not touched nor copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraserve.types import SamplingParams


def process_logits(
    logits: torch.Tensor,  # [B, V] float32, one row per sampling request
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    """Returns `logits` itself when no row needs processing, else a processed copy.
    Each step is one op over every row that asks for it, on flat (row * V + token) indices
    of the tokens concerned only: the cost follows the tokens seen, not B x V."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    flat = logits.view(-1)

    def flat_index(per_row: dict[int, Sequence[int]]) -> torch.Tensor:
        parts = [torch.as_tensor(list(toks), dtype=torch.long) + i * vocab
                 for i, toks in per_row.items() if len(toks)]
        idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
        return idx.to(logits.device)

    bias = {i: params[i].logit_bias for i in rows if params[i].logit_bias}
    if bias:
        values = [b for i in bias for _, b in bias[i]]
        flat.index_add_(0, flat_index({i: [t for t, _ in b] for i, b in bias.items()}),
                        torch.tensor(values, dtype=logits.dtype, device=logits.device))
    masked = {i: _stop_ids(params[i], eos_token_ids, vocab) for i in rows
              if len(outputs[i]) < params[i].min_tokens}
    if masked:
        flat[flat_index(masked)] = float("-inf")
    # Penalties touch only the tokens a row has seen: gather, compute, scatter back.
    rep = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep:
        idx = torch.cat([flat_index({i: prompts[i] for i in rep}),
                         flat_index({i: outputs[i] for i in rep})]).unique()
        r = _per_row(logits, params, "repetition_penalty")[idx // vocab]
        x = flat[idx]
        flat[idx] = torch.where(x > 0, x / r, x * r)
    pen = [i for i in rows if (params[i].frequency_penalty or params[i].presence_penalty)
           and len(outputs[i])]
    if pen:
        idx, counts = flat_index({i: outputs[i] for i in pen}).unique(return_counts=True)
        row = idx // vocab
        flat[idx] -= (_per_row(logits, params, "frequency_penalty")[row] * counts
                      + _per_row(logits, params, "presence_penalty")[row])
    return logits


def _per_row(logits: torch.Tensor, params: Sequence[SamplingParams], name: str) -> torch.Tensor:
    return torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype,
                        device=logits.device)


def _stop_ids(p: SamplingParams, eos_token_ids: frozenset[int], vocab: int) -> list[int]:
    """Tokens that would end the output: masked while it is shorter than min_tokens."""
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    return sorted(t for t in stops if t < vocab)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's (after temperature;
    `logits`: [V]). The top token always stays."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
