"""An adapter's parts at the embedding lookup and the output layer (lora/extras.VocabParts),
from PEFT's tensors and config:

- LoRA on `embed_tokens` (lora_embedding_A [r, V] / _B [d, r]: a lookup of A's columns) and on
  `lm_head` (a linear's lora_A / lora_B); with `ensure_weight_tying` on a tied model,
  lm_head's LoRA is the embedding's, saved under lm_head too;
- `base_layer.weight`, which PEFT saves next to a targeted embedding: dropped when equal to the
  model's, else this adapter's own table (PEFT loads it over the base weight);
- modules_to_save (`lm_head`, `embed_tokens`): the adapter's full copy of the module;
- trainable_token_indices: new rows for those tokens; on a tied model the embedding's rows
  serve lm_head too, as PEFT ties them (unless lm_head has other indices of its own).

An adapter whose tables have another vocabulary size than the model's is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from loraserve.adapters.peft.base_weights import BaseWeights
from loraserve.adapters.peft.modules import float_tensor
from loraserve.config import ModelConfig
from loraserve.lora.extras import VocabParts
from loraserve.types import AdapterFormatError

ENDS = ("embed_tokens", "lm_head")
_NAMES = {"embed_tokens": "embed_tokens", "model.embed_tokens": "embed_tokens",
          "lm_head": "lm_head"}


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def _ends(value, field: str, path: object) -> dict[str, object]:
    """modules_to_save / trainable_token_indices keyed by our end names."""
    if value is None:
        return {}
    if field == "trainable_token_indices" and isinstance(value, list):
        value = {"embed_tokens": value}
    items = value.items() if isinstance(value, dict) else ((v, None) for v in value)
    out = {}
    for k, v in items:
        if not isinstance(k, str) or k not in _NAMES:
            raise _fail(path, f"{field} names {k!r}: only embed_tokens and lm_head are "
                              f"supported")
        out[_NAMES[k]] = v
    return out


def check_vocab_config(cfg: dict, mc: ModelConfig | None, path: object) -> None:
    """The config's modules_to_save / trainable_token_indices / ensure_weight_tying."""
    mts = cfg.get("modules_to_save")
    if mts is not None and not (isinstance(mts, list) and all(isinstance(m, str) for m in mts)):
        raise _fail(path, f"modules_to_save must be a list of module names, got {mts!r}")
    saved = _ends(mts, "modules_to_save", path)
    tokens = _ends(cfg.get("trainable_token_indices"), "trainable_token_indices", path)
    for end, idx in tokens.items():
        if not (isinstance(idx, list) and idx and all(
                isinstance(i, int) and not isinstance(i, bool) for i in idx)):
            raise _fail(path, f"trainable_token_indices for {end} must be a list of token ids")
        if len(set(idx)) != len(idx):
            raise _fail(path, f"trainable_token_indices for {end} repeats a token id")
        if mc is not None and not all(0 <= i < mc.vocab_size for i in idx):
            raise _fail(path, f"trainable_token_indices for {end} has a token outside the "
                              f"model's vocabulary of {mc.vocab_size} (adapters that change "
                              f"the vocabulary size are not supported)")
        if end in saved:
            raise _fail(path, f"{end} is in both modules_to_save and trainable_token_indices")
    if (saved and cfg.get("ensure_weight_tying") and mc is not None
            and mc.tie_word_embeddings):
        raise _fail(path, "modules_to_save with ensure_weight_tying on a model with tied "
                          "embeddings is not supported yet")


def check_vocab_size(shapes: Mapping[str, Sequence[int]], mc: ModelConfig,
                     path: object) -> None:
    """Refuse, before anything else is parsed (from the file's header when it has one), an
    adapter saved from a model whose vocabulary was resized: any embedding or lm_head table,
    or its LoRA's vocabulary side, of another size than the model's. `shapes`: tensor key ->
    its shape."""
    for key, shape in shapes.items():
        if ("embed_tokens" not in key and "lm_head" not in key) or len(shape) != 2:
            continue
        if "lora_embedding_A" in key:
            rows = shape[1]
        elif "lm_head" in key and ".lora_B" in key or not any(
                k in key for k in ("lora_A", "lora_embedding_B", "trainable_tokens_delta")):
            rows = shape[0]
        else:
            continue
        if rows != mc.vocab_size:
            raise _fail(path, f"tensor {key!r} spans {rows} tokens, the model's vocabulary "
                              f"{mc.vocab_size}: adapters that change the vocabulary size are "
                              f"not supported")


def vocab_parts(path: object, cfg: dict, mc: ModelConfig, plan: dict, parts: dict,
                base: BaseWeights | None) -> VocabParts | None:
    """This adapter's VocabParts (None: it has none). `plan`: end -> (rank, scale) of the
    ends its LoRA targets; `parts`: end -> {part: (key, tensor)}."""
    saved = _ends(cfg.get("modules_to_save"), "modules_to_save", path)
    tokens = _ends(cfg.get("trainable_token_indices"), "trainable_token_indices", path)
    v, d, out = mc.vocab_size, mc.hidden_size, {}
    for end in ENDS:
        p, pre = parts.get(end, {}), "embed" if end == "embed_tokens" else "head"
        lora = ("embedding_A", "embedding_B") if end == "embed_tokens" else ("lora_A", "lora_B")
        allowed = {part for part, on in (("copy", end in saved), ("tokens", end in tokens))
                   if on}
        if end in plan:
            allowed |= {*lora, "base"}
        for part, (key, _) in p.items():
            if part in ("magnitude", "lora_B.bias"):
                what = "DoRA" if part == "magnitude" else "lora_bias"
                raise _fail(path, f"{what} on {end} is not supported yet ({key!r})")
            if part not in allowed:
                raise _fail(path, f"tensor {key!r} ({part} of {end}) is not what "
                                  f"adapter_config declares for {end}")
        for part in allowed - {"base"}:
            if part not in p and not (part == "tokens" and end == "lm_head"):
                raise _fail(path, f"adapter_config declares {end} but its {part} tensor is "
                                  f"missing")
        if end in plan and end in saved:
            raise _fail(path, f"{end} is both a LoRA target and in modules_to_save")
        for part in ("copy", "base"):
            if part in p:
                table = _table(path, *p[part], v, d, end)
                if part == "copy" or not _equals_base(table, end, mc, base):
                    out[f"{pre}_table"] = _scaled(table, mc) if pre == "embed" else table
        if end in plan:
            r, scale = plan[end]
            (ka, a), (kb, b) = p[lora[0]], p[lora[1]]
            if end == "embed_tokens":  # A: [r, V], B: [d, r]
                a, b = float_tensor(path, ka, a, (r, v)), float_tensor(path, kb, b, (d, r))
                out["embed_lora"] = (a.T.contiguous(),
                                     _scaled((b * scale).T.contiguous(), mc))
            else:  # A: [r, d], B: [V, r]
                a, b = float_tensor(path, ka, a, (r, d)), float_tensor(path, kb, b, (v, r))
                out["head_lora"] = (a, (b * scale).T.contiguous())
        if "tokens" in p:
            idx = tokens[end]
            rows = float_tensor(path, *p["tokens"], (len(idx), d))
            ids = torch.tensor(idx, dtype=torch.long)
            out[f"{pre}_rows"] = (ids, _scaled(rows, mc) if pre == "embed" else rows)
    if "embed_rows" in out and "head_rows" not in out and mc.tie_word_embeddings:
        # PEFT ties lm_head's trainable tokens to the embedding's (same indices, same rows)
        head_idx = tokens.get("lm_head")
        if head_idx is None or head_idx == tokens["embed_tokens"]:
            out["head_rows"] = (out["embed_rows"][0], float_tensor(
                path, *parts["embed_tokens"]["tokens"], (-1, d)))
    if "lm_head" in tokens and "head_rows" not in out:
        raise _fail(path, "trainable_token_indices declares lm_head but its tensor is missing")
    return VocabParts(**out) if out else None


def _table(path, key: str, t: torch.Tensor, v: int, d: int, end: str) -> torch.Tensor:
    if t.dim() == 2 and t.shape[1] == d and t.shape[0] != v:
        raise _fail(path, f"{end} has {t.shape[0]} rows in {key!r}, the model's vocabulary "
                          f"has {v}: adapters that change the vocabulary size are not supported")
    return float_tensor(path, key, t, (v, d))


def _scaled(t: torch.Tensor, mc: ModelConfig) -> torch.Tensor:
    """Embedding-side rows as the model's embedding scales them (the loader's same op)."""
    if mc.embed_scale == 1.0:
        return t
    return t * torch.tensor(mc.embed_scale, dtype=t.dtype)


def _equals_base(table: torch.Tensor, end: str, mc: ModelConfig, base: BaseWeights | None
                 ) -> bool:
    if base is None:
        return False  # kept as the adapter's own: exact either way
    if end == "embed_tokens":
        return torch.equal(_scaled(table, mc), base.embed().to(torch.float32))
    return torch.equal(table, base.lm_head().to(torch.float32))
