"""One decoder linear's LoRA from its saved parts: A and B checked against the base shape and
the config, B scaled; lora_bias's bias scaled the same; DoRA's column scale computed once, here
at load, from the base weight:

    scale = m / ||W + s B A||_c        (PEFT's weight norm: one per output row of W, detached)

so a step computes `scale * (W x + s B A x)`, exactly PEFT's `use_dora` forward
(peft/tuners/lora/dora.py), as an epilogue (lora/extras.py).

A LoRA on a fused module (Phi-3's qkv_proj) is one delta on the whole fused output; it is
handed on as the modules it fuses, each with the same A and its rows of B (and of the bias
and the scale): exactly the same delta, in the layout every LoRA backend already takes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraserve.adapters.peft.targets import FUSED_MODULES
from loraserve.config import ModelConfig
from loraserve.types import AdapterFormatError


@dataclass(frozen=True)
class LoraModuleWeights:
    A: torch.Tensor  # [r, d_in] float32, contiguous
    B: torch.Tensor  # [d_out, r] float32, contiguous, already multiplied by `scale`
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with rslora), after rank/alpha patterns
    bias: torch.Tensor | None = None  # [d_out] lora_bias: scale * lora_B.bias
    col_scale: torch.Tensor | None = None  # [d_out] DoRA: m / ||W + scale * B A||_c

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.A, self.B, self.bias, self.col_scale)
                   if t is not None)


# (layer, module) -> the base model's [d_out, d_in] weight of that linear, float32
BaseWeight = Callable[[int, str], torch.Tensor]


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def float_tensor(path: object, key: str, t: torch.Tensor, shape: tuple[int, ...]
                 ) -> torch.Tensor:
    """A saved tensor as float32, checked: floating, of `shape` (-1: any), finite."""
    if not t.is_floating_point():
        raise _fail(path, f"tensor {key!r} has non-float dtype {t.dtype}")
    if t.dim() != len(shape) or any(w not in (-1, n) for n, w in zip(t.shape, shape,
                                                                       strict=True)):
        want = ", ".join("?" if w == -1 else str(w) for w in shape)
        raise _fail(path, f"tensor {key!r} has shape {list(t.shape)}, expected [{want}]")
    out = t.to(torch.float32).contiguous()
    if not torch.isfinite(out).all():
        raise _fail(path, f"tensor {key!r} contains NaN or inf")
    return out


def module_weights(path, name: str, layer: int, module: str, parts: dict, mc: ModelConfig,
                   want_rank: int, scale: float, dora: bool, lora_bias: bool,
                   base_weight: BaseWeight | None) -> LoraModuleWeights:
    """Check one module's parts ({part: (key, tensor)}) against the base shape and the
    config; scale B (and the bias); compute DoRA's column scale."""
    d_out, d_in = mc.module_shape(module)
    for need in ("lora_A", "lora_B"):
        if need not in parts:
            raise _fail(path, f"{name} has no {need} tensor")
    (ka, a), (kb, b) = parts["lora_A"], parts["lora_B"]
    a = float_tensor(path, ka, a, (-1, d_in))
    b = float_tensor(path, kb, b, (d_out, -1))
    rank = a.shape[0]
    if b.shape[1] != rank:
        raise _fail(path, f"A/B rank mismatch for {name}: lora_A has rank {rank}, "
                          f"lora_B has rank {b.shape[1]}")
    if rank != want_rank:
        raise _fail(path, f"{name} has rank {rank} in its tensors but rank {want_rank} "
                          f"in adapter_config (r / rank_pattern)")
    bias = None
    if "lora_B.bias" in parts:
        if not lora_bias:
            raise _fail(path, f"{name} has a lora_B bias but adapter_config has no lora_bias")
        bias = float_tensor(path, *parts["lora_B.bias"], (d_out,)) * scale
    elif lora_bias:
        raise _fail(path, f"adapter_config sets lora_bias but {name} has no lora_B bias")
    b_scaled = (b * scale).contiguous()
    col_scale = None
    if "magnitude" in parts:
        if not dora:
            raise _fail(path, f"{name} has a DoRA magnitude but adapter_config has no use_dora")
        if base_weight is None:
            raise _fail(path, "DoRA adapters need the base model's weights to be read")
        mag = float_tensor(path, *parts["magnitude"], (d_out,))
        w = base_weight(layer, module).to(torch.float32)
        norm = torch.linalg.norm(w + b_scaled @ a, dim=1)
        col_scale = (mag / norm).contiguous()
        if not torch.isfinite(col_scale).all():
            raise _fail(path, f"{name}: DoRA's column norm ||W + sBA|| is zero")
    elif dora:
        raise _fail(path, f"adapter_config sets use_dora but {name} has no magnitude vector")
    return LoraModuleWeights(A=a, B=b_scaled, rank=rank, scale=float(scale), bias=bias,
                             col_scale=col_scale)


def unfused(module: str, w: LoraModuleWeights, mc: ModelConfig) -> dict[str, LoraModuleWeights]:
    """A fused module's LoRA as the modules it fuses: the same A (one tensor), its B's rows."""
    if module not in FUSED_MODULES:
        return {module: w}
    out, row = {}, 0
    for sub in FUSED_MODULES[module]:
        rows = slice(row, row + mc.module_shape(sub)[0])
        out[sub] = LoraModuleWeights(
            A=w.A, B=w.B[rows].contiguous(), rank=w.rank, scale=w.scale,
            bias=None if w.bias is None else w.bias[rows].contiguous(),
            col_scale=None if w.col_scale is None else w.col_scale[rows].contiguous())
        row = rows.stop
    return out
