"""Rotary frequencies for every rope type we compute exactly as transformers does.

`rope_scaling_from_hf` reads HF's `rope_parameters` and refuses the rest (one line naming the
field); `inv_freq` turns the result into per-pair frequencies for `RotaryEmbedding`.
"""

from __future__ import annotations

import math

import torch

from loraserve.config import RopeScaling

# rope types and the keys each one reads (besides rope_type/type and rope_theta)
_KEYS = {
    "default": (),
    "linear": ("factor",),
    # NTK scaling changes frequencies only for sequences longer than max_position_embeddings,
    # which the engine never serves (max_model_len is capped there): inside, it is 'default'.
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def rope_scaling_from_hf(params: dict | None, where: str) -> RopeScaling:
    """`params`: the HF config's rope_parameters (or legacy rope_scaling), after transformers'
    own defaults were filled in. `where` names the model in errors."""
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in _KEYS:
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported "
                         f"(supported: {', '.join(_KEYS)})")
    partial = params.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor={partial} is not supported "
                         "(RoPE over the whole head only)")
    if rope_type != "default" and params.get("attention_factor") not in (None, 1, 1.0):
        raise ValueError(f"{where}: rope attention_factor={params['attention_factor']} is not "
                         f"supported with rope type {rope_type!r}")
    values = {}
    for key in _KEYS[rope_type]:
        v = params.get(key)
        if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"{where}: rope_parameters.{key} must be a positive number for "
                             f"rope type {rope_type!r}, got {v!r}")
        values[key] = v
    if rope_type == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ValueError(f"{where}: rope_parameters.high_freq_factor must exceed "
                         "low_freq_factor")
    if "original_max_position_embeddings" in values:
        values["original_max_position_embeddings"] = int(
            values["original_max_position_embeddings"])
    return RopeScaling(rope_type=rope_type, **values)


def inv_freq(head_dim: int, theta: float, rs: RopeScaling) -> torch.Tensor:
    """[head_dim/2] float64 inverse frequencies (transformers' formulas, in float64)."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rs.rope_type == "linear":
        return freq / rs.factor
    if rs.rope_type == "llama3":
        return _llama3(freq, rs)
    return freq  # default, and dynamic inside max_position_embeddings


def _llama3(freq: torch.Tensor, rs: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rs.original_max_position_embeddings
    low_wavelen = old_len / rs.low_freq_factor
    high_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rs.factor, freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor
                                                         - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
