"""Projections over bfloat16 weights on CPU (`--dtype bfloat16` there): half the bytes a token
reads, computed by oneDNN's bf16 matmul with float32 accumulation (ops/bf16_gemm.py).

Only the projections are bf16. Their inputs are the model's float32 activations, rounded to
bf16 at the matmul (the instructions take bf16 on both sides); their outputs are widened back
to float32, so the residual stream, norms, attention and the KV cache stay float32, and the
LoRA op adds its deltas in float32 to the widened output, from the float32 input: an adapter's
part is computed exactly as with float32 weights (the fused GEMM + LoRA kernels are float32
only, so the LoRA backend runs its separate op after the projection).
"""

from __future__ import annotations

import torch

from loraserve.ops.bf16_gemm import bf16_linear, pack_bf16, unpack_bf16


class Bf16Linear:
    """`y = x @ W.T (+ b)` over a `[d_out, d_in]` weight stored in bf16; x and y float32."""

    panels = None  # not our float32 GEMM's layout: LoRA backends run their op after it

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.itemsize = 2
        self._packed = pack_bf16(weight)
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias of shape {list(bias.shape)} for a "
                                 f"{list(weight.shape)} weight")
            # float32: added after the widening, as the LoRA epilogues expect (lora/extras.py)
            self.bias = bias.detach().to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, d_in] -> [T, d_out]
        y = bf16_linear(x, self._packed)
        bias = getattr(self, "bias", None)
        if bias is not None:
            y += bias
        return y

    @property
    def weight(self) -> torch.Tensor:
        """The `[d_out, d_in]` bf16 weight as a plain tensor (a copy)."""
        return unpack_bf16(self._packed)

    @property
    def nbytes(self) -> int:
        bias = getattr(self, "bias", None)
        return (self.out_features * self.in_features * self.itemsize
                + (bias.nbytes if bias is not None else 0))
