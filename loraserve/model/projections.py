"""How the loader builds each projection of a model, by quantization scheme:

- "none": float32 (model/linear.Linear), as the checkpoint holds it;
- "int8" / "int4": quantized at load from the float32 weights (ops/quant_formats.py: int8 per
  output channel, int4 per block of 32 as GGUF's Q4_0). The vocabulary projection (lm_head)
  takes int8 under both: it is the largest matrix of a small model and the one whose error
  moves the argmax most, so 4 bits there cost the most agreement for the bytes saved;
- "gguf": a GGUF model's own quantized tensors, as the file holds them (model/gguf_weights.py),
  lm_head included (the embedding table's, when tied).

Embedding lookups and norms stay float32 under every scheme: a lookup reads one row a token.
With bf16 weights (`--dtype bfloat16` on CPU, scheme "none" only) every projection, experts and
lm_head included, is a model/bf16_linear.Bf16Linear.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.model.bf16_linear import Bf16Linear
from loraserve.model.gguf_weights import GGUFProjections
from loraserve.model.quant_linear import (
    QuantLinear,
    float_linear,
    quant_linear,
    quantized_or_float,
    require_kernel,
)

SCHEMES = ("none", "int8", "int4", "gguf")
HEAD_SCHEME = "int8"  # lm_head under int8 and int4 (see above)


class ProjectionBuilder:
    def __init__(self, scheme: str, gguf_file: Path | None = None, num_heads: int = 0,
                 num_kv_heads: int = 0, bf16_weights: bool = False):
        if scheme not in SCHEMES:
            raise ValueError(f"quantization must be one of {list(SCHEMES)}, not {scheme!r}")
        if scheme == "gguf" and gguf_file is None:
            raise ValueError("quantization gguf serves a GGUF model's own tensors: the model "
                             "must be a .gguf file (or the bundled model)")
        if scheme != "none":
            require_kernel(scheme)
            if bf16_weights:
                raise ValueError(f"quantization {scheme} with bfloat16 weights: choose one")
        self.scheme, self.bf16_weights = scheme, bf16_weights
        self.gguf = (GGUFProjections(gguf_file, num_heads, num_kv_heads)
                     if scheme == "gguf" else None)

    def __call__(self, names: list[str], weight: torch.Tensor,
                 bias: torch.Tensor | None) -> object:
        """The projection of the modules `names` (prefixes of .weight), rows stacked; `weight`
        is their float32 weight from the checkpoint."""
        if self.bf16_weights:
            return Bf16Linear(weight, bias)
        if self.scheme == "none" or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return float_linear(weight, bias)
        if self.gguf is not None:
            q = self.gguf.weight([n + ".weight" for n in names], weight)
            return float_linear(weight, bias) if q is None else quant_linear(q, bias)
        return quantized_or_float(weight, bias, self.scheme, "+".join(names))

    def expert(self, name: str, weight: torch.Tensor) -> object:
        """One expert's bias-free projection: quantized under int8/int4 like the dense ones;
        float32 under gguf (a GGUF file fuses each layer's experts into one tensor, which
        the grouped expert GEMM does not read; the log says so)."""
        if self.scheme in ("int8", "int4") and weight.dtype == torch.float32 \
                and weight.device.type == "cpu":
            return quantized_or_float(weight, None, self.scheme, name)
        if self.bf16_weights:
            return Bf16Linear(weight)
        if self.gguf is not None and name.endswith("0.gate_up"):
            self.gguf.float_kept.append(f"{name.rsplit('.', 2)[0]} (fused experts)")
        return float_linear(weight, None)

    def head(self, weight: torch.Tensor) -> object:
        """lm_head over `weight` (the embedding table when tied)."""
        if self.scheme in ("int8", "int4"):
            return quantized_or_float(weight, None, HEAD_SCHEME, "lm_head")
        return self(["lm_head"], weight, None)

    def finish(self) -> None:
        if self.gguf is not None:
            self.gguf.log_float_kept()


def weight_format(linear: object) -> str:
    """What a built projection computes with: its quantized format, or float32."""
    if isinstance(linear, QuantLinear):
        return linear.format
    return "bfloat16" if isinstance(linear, Bf16Linear) else "float32"
