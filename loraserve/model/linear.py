"""Dense projections `y = x @ W.T` on the fastest GEMM the weight's device and dtype have.

float32 on CPU (loraserve/ops/gemm.py picks per ISA): packed once at load time for our AVX2
kernel or for oneDNN (the plain weight is not kept; `weight` unpacks a copy on demand), else
MKL on the transposed weight. Anything else (a GPU, bf16/fp16): F.linear on the plain weight,
cuBLAS's job.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraserve.ops.gemm import (
    gemm_backend,
    onednn_linear,
    pack_panels,
    pack_weight,
    panel_linear,
    unpack_panels,
)


class Linear:
    """A bias-free linear layer over a `[d_out, d_in]` weight (nn.Linear's orientation)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.itemsize = weight.element_size()
        on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.backend = gemm_backend() if on_cpu else "plain"
        self._plain = None if on_cpu else weight.detach().contiguous()
        self._panels = None
        if not on_cpu:
            self._packed = self._weight_t = None
        elif self.backend == "avx2":
            self._panels = pack_panels(weight)
            self._packed = self._weight_t = None
        elif self.backend == "onednn":
            self._packed = pack_weight(weight)
            self._weight_t = None
        else:
            # [d_in, d_out]: MKL's NN GEMM streams weights faster than F.linear's NT at batch 1.
            self._packed = None
            self._weight_t = weight.detach().t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, d_in] -> [T, d_out]
        if self._panels is not None:
            return panel_linear(x, self._panels, self.out_features)
        if self._packed is not None:
            return onednn_linear(x, self._packed)
        if self._plain is not None:
            return F.linear(x, self._plain)
        return torch.mm(x, self._weight_t)

    @property
    def panels(self) -> torch.Tensor | None:
        """The weight packed for our GEMM (ops/gemm.pack_panels), or None on another backend;
        for fused callers (lora/backends/cpu_kernel.py) that run the GEMM themselves."""
        return self._panels

    @property
    def weight(self) -> torch.Tensor:
        """The `[d_out, d_in]` weight as a plain tensor (a copy when packed)."""
        if self._panels is not None:
            return unpack_panels(self._panels, self.out_features)
        if self._packed is not None:
            return self._packed.to_dense()
        if self._plain is not None:
            return self._plain
        return self._weight_t.t()

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.itemsize


class BiasedLinear(Linear):
    """`y = x @ W.T + b` (Qwen2's q/k/v, Llama's attention_bias/mlp_bias); a subclass so that
    bias-free models pay nothing for it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__(weight)
        if bias.shape != (self.out_features,):
            raise ValueError(f"bias of shape {list(bias.shape)} for a {list(weight.shape)} weight")
        self.bias = bias.detach().contiguous()  # [d_out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = super().__call__(x)
        y += self.bias  # y is a fresh tensor: in place saves an allocation
        return y

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.out_features * self.itemsize
