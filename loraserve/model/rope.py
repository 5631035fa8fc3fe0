"""Rotary frequencies for every rope type we compute exactly as transformers does.

`rope_scaling_from_hf` reads HF's `rope_parameters` and refuses the rest (one line naming the
field); `inv_freq` turns the result into per-pair frequencies for `RotaryEmbedding`, which
also multiplies cos/sin by `attention_factor` (yarn).
"""

from __future__ import annotations

import math

import torch

from loraserve.config import RopeScaling

# rope types and the keys each one needs (besides rope_type/type and rope_theta)
_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    # NTK scaling changes frequencies only for sequences longer than max_position_embeddings,
    # which the engine never serves (max_model_len is capped there): inside, it is 'default'.
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    # Phi-3: per-pair factors, the short ones up to original_max_position_embeddings (transformers
    # switches to the long ones past it, recomputing every position; we serve only the short
    # ones and cap the context there instead, see families.py)
    "longrope": ("original_max_position_embeddings",),
}


def _positive(params: dict, key: str, where: str, rope_type: str) -> float:
    v = params.get(key)
    if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
        raise ValueError(f"{where}: rope_parameters.{key} must be a positive number for "
                         f"rope type {rope_type!r}, got {v!r}")
    return v


def rope_scaling_from_hf(params: dict | None, where: str, head_dim: int = 0,
                         max_positions: int = 0) -> RopeScaling:
    """`params`: the HF config's rope_parameters (or legacy rope_scaling), after transformers'
    own defaults were filled in. `where` names the model in errors; head_dim and the config's
    max_position_embeddings are read by longrope only."""
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in _REQUIRED:
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported "
                         f"(supported: {', '.join(_REQUIRED)})")
    partial = params.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor={partial} is not supported "
                         "(RoPE over the whole head only)")
    values = {k: _positive(params, k, where, rope_type) for k in _REQUIRED[rope_type]}
    if rope_type == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ValueError(f"{where}: rope_parameters.high_freq_factor must exceed "
                         "low_freq_factor")
    if "original_max_position_embeddings" in values:
        values["original_max_position_embeddings"] = int(
            values["original_max_position_embeddings"])
    if rope_type == "yarn":
        values.update(_yarn_extras(params, values["factor"], where))
    if rope_type == "longrope":
        values.update(_longrope_extras(params, values["original_max_position_embeddings"],
                                       head_dim, max_positions, where))
    return RopeScaling(rope_type=rope_type, **values)


def _longrope_extras(params: dict, old_len: int, head_dim: int, max_positions: int,
                     where: str) -> dict:
    short = params.get("short_factor")
    if not (isinstance(short, list) and len(short) == head_dim // 2
            and all(isinstance(f, int | float) and f > 0 for f in short)):
        raise ValueError(f"{where}: rope_parameters.short_factor must list {head_dim // 2} "
                         "positive numbers")
    af = params.get("attention_factor")
    if af is None:  # transformers' default: from the factor, else the context ratio
        factor = params.get("factor") or max_positions / old_len
        af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    _positive({"attention_factor": af}, "attention_factor", where, "longrope")
    return {"short_factor": tuple(float(f) for f in short), "attention_factor": float(af)}


def _yarn_extras(params: dict, factor: float, where: str) -> dict:
    # transformers' defaults: beta_fast 32, beta_slow 1 (also for 0/None), truncate True
    extras = {"beta_fast": params.get("beta_fast") or 32.0,
              "beta_slow": params.get("beta_slow") or 1.0,
              "truncate": params.get("truncate", True)}
    if not isinstance(extras["truncate"], bool):
        raise ValueError(f"{where}: rope_parameters.truncate must be true or false")
    for key in ("beta_fast", "beta_slow"):
        _positive(extras, key, where, "yarn")
    af = params.get("attention_factor")
    if af is None:  # the paper's suggestion, as transformers derives it
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            af = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            af = _yarn_mscale(factor)
    extras["attention_factor"] = float(_positive({"attention_factor": af},
                                                 "attention_factor", where, "yarn"))
    return extras


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(head_dim: int, theta: float, rs: RopeScaling) -> torch.Tensor:
    """[head_dim/2] float64 inverse frequencies (transformers' formulas, in float64)."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rs.rope_type == "linear":
        return freq / rs.factor
    if rs.rope_type == "llama3":
        return _llama3(freq, rs)
    if rs.rope_type == "yarn":
        return _yarn(freq, head_dim, theta, rs)
    if rs.rope_type == "longrope":
        return freq / torch.tensor(rs.short_factor, dtype=torch.float64)
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


def _yarn(freq: torch.Tensor, dim: int, theta: float, rs: RopeScaling) -> torch.Tensor:
    # Pairs that turn fewer than beta_slow times over the original context are interpolated
    # (slowed by `factor`), those turning more than beta_fast times kept, a ramp between.
    def pair_index(rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = pair_index(rs.beta_fast), pair_index(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero, as transformers does
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return freq / rs.factor * (1 - keep) + freq * keep
