"""Batched multi-LoRA ops: a plain per-token reference and the segmented fast op.

The fast op follows Punica's SGMV: tokens of one adapter are contiguous, so each segment
costs one shrink and one expand per module on *views* of the slot pool (no weight copies),
sized by that adapter's packed rank, never by max_lora_rank. The engine sends every segment
to the C kernel (lora/sgmv_cpu.c, one call per layer and group); the matmuls here serve where
no kernel could be built, and batches built with a length limit. Gathering per-token weights
for bmm is far slower: it copies weights every call (benchmarks/lora_op_micro.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from loraserve.lora.batch import LoraBatch
from loraserve.lora.layout import B_STRIP, GroupLayout
from loraserve.lora.sgmv_cpu import sgmv
from loraserve.model.linear import onednn_linear

if TYPE_CHECKING:
    from loraserve.adapters.format import LoraModuleWeights


def apply_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    group_A: torch.Tensor,
    group_B: torch.Tensor,
    batch: LoraBatch,
    group: str,
    kernel: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """y += LoRA delta of `group` for every token that uses an adapter; in place, returns y.

    x: [T, d_in] group input; y: [T, d_out_g] fused group output (rows must be contiguous)
    group_A: [S, R_g * d_in], group_B: [S, max_rank * d_out_g] (LoraSlotPool.A/B[layer][group])
    kernel: the C library (lora/sgmv_cpu.py) for the batch's `kernel_plans`.
    """
    kplan = batch.kernel_plans.get(group)
    if kplan is not None:
        if kernel is None:
            raise ValueError("batch was built for the C kernel but none was given")
        sgmv(kernel, x, y, group_A, group_B, *kplan)
    plan = batch.plans.get(group)
    if not plan:  # base-only batch, or no adapter in it targets this group: no work at all
        return y
    onednn = batch.onednn  # 1.3-2x MKL's sgemm on long segments here (model/linear.py)
    for xs, tiles, parts in plan:
        xseg = x[xs]
        # t: [n, padded rank] = x[a:b] @ A.T, one matmul per [d_in, <= 64] tile of A.T
        # (.to: bf16-stored weights are widened per call on this fallback path)
        ts = [onednn_linear(xseg, group_A[idx].view(shape).to(x.dtype).t()) if onednn
              else torch.mm(xseg, group_A[idx].view(shape).to(x.dtype)) for idx, shape in tiles]
        t = ts[0] if len(ts) == 1 else torch.cat(ts, dim=1)
        ys = y[xs]  # ys: [n, d_out_g], a view: in-place updates write through
        for t_idx, y_idx, b_idx, shape in parts:
            # ys[:, c0:c1] += t[:, o0:o1] @ (the module's [o1 - o0, c1 - c0] block of B[s])
            out = ys if y_idx is None else ys[y_idx]
            tp = t if t_idx is None else t[t_idx]
            _expand_strips(out, tp, group_B[b_idx].to(x.dtype), *shape)
    return y


def _expand_strips(out: torch.Tensor, t: torch.Tensor, block: torch.Tensor, r: int,
                   d: int) -> None:
    """out [n, d] += t [n, r] @ B.T, B.T stored in `block` as [r, 64] column strips and a
    narrower last strip (layout.b_strips): one batched matmul over the whole strips."""
    n, full = out.shape[0], d // B_STRIP * B_STRIP
    if full:
        strips = block[: r * full].view(full // B_STRIP, r, B_STRIP)  # [k, r, 64]
        delta = torch.matmul(t, strips)  # [k, n, 64]
        out[:, :full].view(n, full // B_STRIP, B_STRIP).add_(delta.transpose(0, 1))
    if full < d:
        out[:, full:].addmm_(t, block[r * full :].view(r, d - full))


def lora_reference(
    x: torch.Tensor,
    y: torch.Tensor,
    token_modules: Sequence[Mapping[str, LoraModuleWeights] | None],
    layout: GroupLayout,
) -> torch.Tensor:
    """Readable reference, straight from the adapters' own weights (not the pool):
    for each token t and module m of the group, y[t, cols_m] += (x[t] @ A_m.T) @ B_m.T.

    x: [T, d_in]; y: [T, d_out_g], updated in place and returned
    token_modules[t]: that token's adapter's modules in this layer (None = base model)
    """
    if len(token_modules) != x.shape[0]:
        raise ValueError(f"{len(token_modules)} token entries for {x.shape[0]} tokens")
    for t, mods in enumerate(token_modules):
        if not mods:
            continue
        for m, c0, d in zip(layout.modules, layout.col_offsets, layout.d_outs, strict=True):
            mw = mods.get(m)
            if mw is not None:
                y[t, c0 : c0 + d] += (x[t] @ mw.A.T) @ mw.B.T  # B already carries the scale
    return y
