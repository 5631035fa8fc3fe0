"""Write a tiny HF Llama checkpoint as a GGUF file, the way llama.cpp's converter does: its
tensor names, q/k rows permuted for its rope layout, the byte-level BPE tokenizer (vocab,
merges, special ids) and the chat template in the metadata; weights float32 or quantized
(Q8_0, Q4_0, ...)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf in _NAMES:
        return _NAMES[hf]
    _, _, i, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{i}.{_LAYER[module]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf: q/k rows from rotate-half to interleaved pairs
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def random_q4k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Q4_K blocks of random bytes (any bytes are a valid block; gguf has no Q4_K quantizer)
    with small finite d and dmin: a `[rows, cols]` weight of llama.cpp's layout."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, size=(rows, cols // 256, 2)).astype(np.float16)
    raw[..., 0:4] = scales.view(np.uint8).reshape(rows, cols // 256, 4)
    return raw.reshape(rows, -1)


def write_llama_gguf(hf_dir: Path, out: Path, quant: str = "F32") -> Path:
    """Q4_K writes random blocks in place of the 2-D weights (the file is its own model)."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template")
    if template is None:
        template = (hf_dir / "chat_template.jinja").read_text()
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(hf_dir.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    # the tokenizer: every id's token (added tokens included), merges, specials
    vocab = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # control / normal
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_chat_template(template)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    sd = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    for name, t in sorted(sd.items()):
        a = t.to(torch.float32).numpy()
        if name.endswith("q_proj.weight"):
            a = _permute(a, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            a = _permute(a, cfg["num_key_value_heads"])
        if a.ndim == 2 and quant == "Q4_K":
            w.add_tensor(_gguf_name(name), random_q4k(*a.shape, seed=len(name)), raw_dtype=qtype)
        elif a.ndim == 2 and quant != "F32":
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
