"""A GGUF file's quantized projections, read as they are (no dequantization), by the Hugging
Face names of the checkpoint converted from it (model/bundled.py).

The converted checkpoint stays the source of everything else (config, tokenizer, norms,
embeddings) and the check of this one: each projection served from the file must decode to
exactly the float32 tensor the conversion wrote, or the file is refused. Tensors of a type not
served quantized (F32, F16, Q6_K, ...), and fused projections whose parts differ in type, are
computed from the converted float32 weights, and the log lists them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from loraserve.ops.quant_formats import GGUF_FORMATS, QuantWeight, from_gguf, supports

log = logging.getLogger("loraserve.model")


class GGUFProjections:
    """The quantized tensors of one GGUF file, by HF name."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int):
        import gguf

        self.path = path
        self.reader = gguf.GGUFReader(path)
        field = self.reader.fields["general.architecture"]
        self.arch = bytes(field.parts[field.data[0]]).decode()
        arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch), None)
        if arch is None:
            raise ValueError(f"GGUF file {path}: architecture {self.arch!r} is unknown to gguf")
        self.tensors = {t.name: t for t in self.reader.tensors}
        blocks = 1 + max((int(n.split(".")[1]) for n in self.tensors if n.startswith("blk.")),
                         default=0)
        self.names = gguf.get_tensor_name_map(arch, blocks)
        self.heads = {"q_proj": num_heads, "k_proj": num_kv_heads}
        self.float_kept: list[str] = []

    def _tensor(self, hf_name: str):
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None or name not in self.tensors:
            if hf_name == "lm_head.weight":  # tied: the file's embedding table is the head
                name = "token_embd.weight"
            if name not in self.tensors:
                return None
        return self.tensors[name]

    def weight(self, hf_names: list[str], expected: torch.Tensor) -> QuantWeight | None:
        """The fused projection of `hf_names` (full tensor names, rows stacked in that order)
        in the file's format, or None where it is not served quantized (then logged). It must
        decode to `expected`, the converted float32 weight, exactly."""
        tensors = [self._tensor(n) for n in hf_names]
        kinds = {t.tensor_type.name if t is not None else None for t in tensors}
        label = "+".join(hf_names)
        if len(kinds) != 1 or None in kinds or next(iter(kinds)) not in GGUF_FORMATS:
            self.float_kept.append(f"{label} ({'/'.join(sorted(map(str, kinds)))})")
            return None
        qtype = kinds.pop()
        k = expected.shape[1]
        if not supports(k) or (qtype == "Q4_K" and k % 256):
            self.float_kept.append(f"{label} ({qtype}, {k} inputs)")
            return None
        parts = []
        for name, t in zip(hf_names, tensors, strict=True):
            raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)
            part = from_gguf(qtype, raw, (raw.shape[0], k))
            module = name.split(".")[-2]
            if self.arch == "llama" and module in self.heads:
                part = _unpermute_rows(part, self.heads[module])
            parts.append(part)
        q = _stack_rows(parts)
        if not torch.equal(q.dequantize(), expected):
            raise ValueError(f"GGUF file {self.path}: {label} ({qtype}) does not decode to the "
                             "weights its conversion holds; serve it without --quantization "
                             "gguf")
        return q

    def log_float_kept(self) -> None:
        if self.float_kept:
            log.info("served as float32 from %s (type not served quantized): %s",
                     self.path.name, ", ".join(self.float_kept))


def _unpermute_rows(q: QuantWeight, heads: int) -> QuantWeight:
    """llama.cpp's converter interleaves q/k rows per head for its rope; the HF order back (as
    transformers' GGUF loader does for llama): rows of quantized weights move whole."""
    n = q.out_features
    index = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
    m = None if q.m is None else q.m[index].contiguous()
    return QuantWeight(q.kind, q.qs[index].contiguous(), q.d[index].contiguous(), m, n,
                       q.in_features, q.source)


def _stack_rows(parts: list[QuantWeight]) -> QuantWeight:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    m = None if first.m is None else torch.cat([p.m for p in parts])
    return QuantWeight(first.kind, torch.cat([p.qs for p in parts]),
                       torch.cat([p.d for p in parts]), m,
                       sum(p.out_features for p in parts), first.in_features, first.source)
