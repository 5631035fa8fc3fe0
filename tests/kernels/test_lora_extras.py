"""The parts of an adapter beyond B @ A (lora/extras.py) through the model's hook
(`LoraStep`), on every LoRA backend, against a per-token reference: DoRA's column scale (with a
base bias, which it leaves unscaled), lora_bias, and the vocabulary ends (embedding LoRA, full
copies, trainable tokens, lm_head LoRA). Rows of base tokens and of plain adapters are left
exactly as the projection computed them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_lora_ops import CFG, MAX_RANK, PATHS, make_adapter

from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.config import LORA_MODULES
from loraserve.lora.backends import LORA_BACKENDS
from loraserve.lora.extras import VocabParts
from loraserve.lora.layout import group_layouts
from loraserve.lora.reference import lora_reference

G = torch.Generator().manual_seed(0)
V, D = CFG.vocab_size, CFG.hidden_size


def _r(*shape, scale=1.0):
    return torch.randn(*shape, generator=G) * scale


def with_epilogue(w, dora: bool, bias: bool):
    layers = tuple({m: replace(mw, col_scale=(1 + 0.5 * _r(mw.B.shape[0])) if dora else None,
                               bias=_r(mw.B.shape[0]) if bias else None)
                    for m, mw in mods.items()} for mods in w.layers)
    return replace(w, layers=layers, fingerprint=w.fingerprint + "x")


VOCAB = VocabParts(embed_lora=(_r(V, 4), _r(4, D, scale=0.3)), head_lora=(_r(4, D), _r(4, V)),
                   embed_rows=(torch.tensor([3, 9]), _r(2, D)), head_table=_r(V, D),
                   head_rows=None)
ADAPTERS = [with_epilogue(make_adapter(1, 8, LORA_MODULES), dora=True, bias=False),
            make_adapter(2, 4, ("q_proj", "down_proj")),  # plain
            with_epilogue(make_adapter(3, 16, ("v_proj", "up_proj")), dora=False, bias=True),
            replace(make_adapter(4, 4, ("o_proj",)), vocab=VOCAB, fingerprint="v")]
SEQS = [(0, 5), (None, 3), (1, 4), (2, 6), (None, 2), (3, 7)]  # (slot, tokens), slot order


class Biased:
    """A projection with a base bias (Qwen2's q/k/v)."""

    def __init__(self, w, b):
        self.w, self.bias = w, b

    def __call__(self, x):
        return F.linear(x, self.w, self.bias)


def _step(path: str):
    """A step of the mixed batch SEQS on the backend of `path`, and each row's slot."""
    pool = LoraSlotPool(CFG, len(ADAPTERS), MAX_RANK)
    for s, w in enumerate(ADAPTERS):
        pool.write(s, w)
    backend = LORA_BACKENDS[PATHS[path]](pool)
    step = backend.step(backend.plan([(s, n) for s, n in SEQS]))
    return step, [s for s, n in SEQS for _ in range(n)]


@pytest.mark.parametrize("path", list(PATHS))
def test_column_epilogues_on_every_backend_equal_the_per_token_reference(path):
    step, slots = _step(path)
    for layer in range(CFG.num_hidden_layers):
        for g, lay in group_layouts(CFG).items():
            x = _r(len(slots), lay.d_in)
            linear = Biased(_r(lay.d_out, lay.d_in, scale=0.2), _r(lay.d_out))
            got = step.project(layer, g, x, linear)
            want = linear(x)
            mods = [None if s is None else ADAPTERS[s].layers[layer] for s in slots]
            lora_reference(x, want, mods, lay)
            for t, m in enumerate(mods):
                for name, c0, d in zip(lay.modules, lay.col_offsets, lay.d_outs, strict=True):
                    mw = (m or {}).get(name)
                    cols = slice(c0, c0 + d)
                    if mw is not None and mw.col_scale is not None:  # PEFT's DoRA forward
                        base = F.linear(x[t], linear.w[cols])
                        lora = want[t, cols] - base - linear.bias[cols]
                        want[t, cols] = (mw.col_scale * (base + lora) + linear.bias[cols])
                    if mw is not None and mw.bias is not None:
                        want[t, cols] += mw.bias
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            base_rows = [t for t, s in enumerate(slots) if s is None]
            assert torch.equal(got[base_rows], linear(x)[base_rows])


@pytest.mark.parametrize("path", list(PATHS))
def test_vocabulary_parts_on_their_rows_only(path):
    step, slots = _step(path)
    ids = torch.randint(0, V, (len(slots),), generator=G)
    ids[-3:] = torch.tensor([3, 9, 5])  # the last adapter's trainable tokens, and another
    table, head_w = _r(V, D), _r(V, D)
    h = step.embed(ids, table)
    rows = torch.tensor([0, 6, 12, 20, 24, 25, 26])  # one sampling row per some tokens
    x = _r(len(rows), D)
    logits = step.head(rows, x, lambda v: F.linear(v, head_w))
    for t, s in enumerate(slots):
        want = table[ids[t]].clone()
        if s == 3:
            if int(ids[t]) in (3, 9):
                want = VOCAB.embed_rows[1][[3, 9].index(int(ids[t]))].clone()
            want += VOCAB.embed_lora[0][ids[t]] @ VOCAB.embed_lora[1]
        torch.testing.assert_close(h[t], want, rtol=1e-5, atol=1e-5)
    for i, t in enumerate(rows.tolist()):
        want = F.linear(x[i], head_w)
        if slots[t] == 3:
            want = F.linear(x[i], VOCAB.head_table) + (VOCAB.head_lora[0] @ x[i]) @ \
                VOCAB.head_lora[1]
        torch.testing.assert_close(logits[i], want, rtol=1e-5, atol=1e-5)
