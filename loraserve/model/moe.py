"""A mixture-of-experts MLP on a flat token batch: top-k routing exactly as transformers'
*TopKRouter computes it (model/families_moe.py), then a grouped expert GEMM.

The T x k (token, expert) pairs are sorted by expert (stably, so each expert's rows stay in
token order), the tokens' rows gathered once, and each expert that has rows runs one gate_up
matmul, the activation and one down matmul over all of them; the outputs are weighted by the
routing weights and scatter-added back to their tokens. Plain torch ops on whatever device
the weights are on, so the same code serves CPU and GPU.

Expert LoRA goes inside that loop: the hook returns, per expert, the runs of its rows that
belong to one adapter (rows of one adapter are contiguous in token order, so they stay
contiguous within each expert's rows), and each run adds its adapter's delta for that expert.
The model sees only those opaque runs, never an adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from loraserve.model.linear import Linear


class ExpertDelta(Protocol):
    """One adapter's LoRA on the experts of one layer."""

    def add(self, part: str, expert: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [n, d_out] += this adapter's delta of `part` ("gate_up" or "down") of `expert`
        on its rows x [n, d_in], in place; nothing where it does not target that part."""


# per expert: (first row, end row, the adapter's delta) of each run of rows with expert LoRA
ExpertRuns = list[list[tuple[int, int, ExpertDelta]]]


class ExpertLoraHook(Protocol):
    def expert_runs(self, layer: int, token_of_row: torch.Tensor, bounds: Sequence[int]
                    ) -> ExpertRuns | None:
        """token_of_row [T*k]: each expert-sorted row's token; bounds: E + 1 row offsets
        where each expert's rows start. None: no adapter of the step has LoRA here."""


@dataclass
class MoeWeights:
    router: torch.Tensor  # [E, d] the router's logits weight
    # per expert, packed for the fastest GEMM like every projection (model/linear.py)
    gate_up: list[Linear]  # d -> 2 * inter: gate_proj over up_proj
    down: list[Linear]  # inter -> d
    top_k: int
    norm_topk: bool
    routing_fp32: bool = False  # weights kept in float32 (Mixtral), else the model's dtype
    shared_gate: torch.Tensor | None = None  # [1, d] Qwen2-MoE's sigmoid gate of its shared expert

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    @property
    def nbytes(self) -> int:
        ts = (self.router, self.shared_gate)
        return (sum(t.nbytes for t in ts if t is not None)
                + sum(lin.nbytes for lin in (*self.gate_up, *self.down)))


def route(x: torch.Tensor, w: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], experts [T, k]) as transformers' routers compute them."""
    logits = F.linear(x, w.router)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, w.top_k, dim=-1)
    if w.norm_topk:
        top /= top.sum(dim=-1, keepdim=True)
    return (top if w.routing_fp32 else top.to(x.dtype)), experts


def moe_forward(x: torch.Tensor, w: MoeWeights, act_mul: Callable, layer: int,
                lora: ExpertLoraHook | None) -> torch.Tensor:
    """x [T, d] -> the experts' weighted sum [T, d] (the shared expert is the caller's)."""
    num_tokens, k = x.shape[0], w.top_k
    weights, experts = route(x, w)
    flat = experts.reshape(-1)  # [T*k], pair p = token p // k
    order = torch.sort(flat, stable=True).indices
    token_of_row = order // k
    counts = torch.bincount(flat, minlength=w.num_experts)
    bounds = [0, *torch.cumsum(counts, 0).tolist()]  # the step's one host sync per layer
    runs = None if lora is None else lora.expert_runs(layer, token_of_row, bounds)
    rows = x[token_of_row]  # [T*k, d]
    out = torch.empty_like(rows)
    inter = w.down[0].in_features
    for e in range(w.num_experts):
        a, b = bounds[e], bounds[e + 1]
        if a == b:
            continue
        xe = rows[a:b]
        gu = w.gate_up[e](xe)  # [n, 2 * inter]
        mine = runs[e] if runs is not None else ()
        for r0, r1, delta in mine:
            delta.add("gate_up", e, xe[r0 - a : r1 - a], gu[r0 - a : r1 - a])
        m = act_mul(gu, inter)  # [n, inter]
        o = w.down[e](m)  # [n, d]
        for r0, r1, delta in mine:
            delta.add("down", e, m[r0 - a : r1 - a], o[r0 - a : r1 - a])
        out[a:b] = o
    out *= weights.reshape(-1)[order].unsqueeze(1)  # in float32 where weights are
    y = torch.zeros((num_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
    return y.index_add_(0, token_of_row, out)


def shared_gate(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """[T, 1] Qwen2-MoE's sigmoid gate on its shared expert's output."""
    return torch.sigmoid(F.linear(x, w.shared_gate))
