"""The LoRA slot pool's invariants (adapters/slot_pool.py): a reused slot is fully overwritten
(the op then adds nothing outside the new adapter's modules), each module's block sits whole
and alone in B, a bad adapter is refused without touching the slot, a cleared slot holds
zeros, 16- and 64-wide tiles lay out the same weights, B's strips are written as laid out,
and a batch merges adjacent runs of one slot. The op against the per-token reference, on
these pools: test_lora_ops.py."""

from __future__ import annotations

import pytest
import torch
from test_lora_ops import (
    ADAPTERS,
    CFG,
    KERNEL,
    MAX_RANK,
    PATHS,
    apply_op,
    backend,
    check_all_groups,
    full_pool,
    make_adapter,
)

from loraserve.adapters.format import LoraAdapterWeights
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.config import LORA_MODULES
from loraserve.lora import sgmv_cpu
from loraserve.lora.backends.torch_matmul import TorchLoraBackend
from loraserve.lora.batch import LoraBatch
from loraserve.lora.layout import GROUPS, TILE_WIDTHS, a_tiles, b_strips, group_layouts


@pytest.mark.parametrize("path", list(PATHS))
def test_reused_slot_is_fully_overwritten(path):
    pool = LoraSlotPool(CFG, 2, MAX_RANK)
    pool.write(0, make_adapter(10, 32, LORA_MODULES))
    only_q = make_adapter(11, 8, ("q_proj",))
    pool.write(0, only_q)
    fresh = LoraSlotPool(CFG, 2, MAX_RANK)
    fresh.write(0, only_q)
    for layer in range(CFG.num_hidden_layers):
        for name in GROUPS:
            assert torch.equal(pool.A[layer][name], fresh.A[layer][name])
            assert torch.equal(pool.B[layer][name], fresh.B[layer][name])
    assert {g: pool.rank(0, g) for g in GROUPS} == {"qkv": 8, "o": 0, "gate_up": 0, "down": 0}
    # the op: k/v columns of qkv and all other groups get exactly zero delta
    b = backend(pool, path)
    plan = b.plan([(0, 5)])
    q = CFG.num_attention_heads * CFG.head_dim
    for layer in range(CFG.num_hidden_layers):
        for name, lay in pool.layouts.items():
            x, y = torch.randn(5, lay.d_in), torch.randn(5, lay.d_out)
            out = apply_op(b, plan, layer, name, x, y.clone())
            keep = slice(q, None) if name == "qkv" else slice(None)
            assert torch.equal(out[:, keep], y[:, keep]), (layer, name)
    check_all_groups(pool, [(0, 3), (None, 2), (0, 1)], [only_q], path=path)


def test_parts_are_contiguous_module_blocks():
    pool = LoraSlotPool(CFG, 3, MAX_RANK)
    pool.write(0, make_adapter(30, 8, LORA_MODULES))
    pool.write(1, make_adapter(32, 8, ("q_proj", "v_proj")))
    inter, q = CFG.intermediate_size, CFG.num_attention_heads * CFG.head_dim
    kv = CFG.num_key_value_heads * CFG.head_dim
    # (rank rows o0:o1 of t, output columns c0:c1, offset of the [rows, cols] block in B)
    assert pool.parts(0, "gate_up") == ((0, 8, 0, inter, 0), (8, 16, inter, 2 * inter, 8 * inter))
    assert pool.parts(1, "qkv") == ((0, 8, 0, q, 0), (8, 16, q + kv, q + 2 * kv, 8 * q))
    assert pool.parts(1, "o") == () and pool.parts(2, "qkv") == ()
    # Nothing past the adapter's blocks is written: B holds just its weights, then zeros.
    for layer in range(CFG.num_hidden_layers):
        assert not pool.B[layer]["qkv"][1, 8 * q + 8 * kv :].any()
        assert pool.B[layer]["qkv"][1, : 8 * q + 8 * kv].any()


def test_batch_merges_adjacent_runs():
    pool = full_pool()
    batch = LoraBatch.build([(0, 3), (0, 2), (None, 4), (1, 0), (1, 1), (1, 1), (0, 2)], pool)
    assert batch.segments == ((0, 0, 5), (1, 9, 11), (0, 11, 13))
    assert batch.num_tokens == 13
    assert batch.token_slots() == [0] * 5 + [-1] * 4 + [1] * 2 + [0] * 2


def test_write_rejects_bad_adapters_without_touching_the_slot():
    pool = LoraSlotPool(CFG, 1, 16)
    good = make_adapter(20, 8, LORA_MODULES)
    pool.write(0, good)
    snapshot = [t.clone() for d in pool.A + pool.B for t in d.values()]
    too_big = make_adapter(21, 32, ("q_proj",))
    one_layer = LoraAdapterWeights("x", 8, frozenset(), good.layers[:1], 0, "x")
    for bad in (too_big, one_layer):
        with pytest.raises(ValueError):
            pool.write(0, bad)
    assert all(
        torch.equal(a, b)
        for a, b in zip(snapshot, [t for d in pool.A + pool.B for t in d.values()], strict=True)
    )
    assert pool.rank(0, "qkv") == 24
    with pytest.raises(IndexError):
        pool.write(1, good)


def test_clear_and_nbytes():
    pool = full_pool()
    pool.clear(1)
    assert all(pool.rank(1, g) == 0 for g in GROUPS)
    assert TorchLoraBackend(pool).plan([(1, 3)]).groups == {}
    assert all(not t[1].any() for d in pool.A + pool.B for t in d.values())
    lays = group_layouts(CFG)
    per_rank = sum(len(lay.modules) * lay.d_in + lay.d_out for lay in lays.values())
    assert pool.nbytes == len(ADAPTERS) * CFG.num_hidden_layers * MAX_RANK * 4 * per_rank


def test_tile_widths_lay_out_the_same_weights():
    # A 16-wide pool holds the same A.T and B.T as a 64-wide one, only cut into narrower tiles
    # and strips; a width the kernels cannot read is refused.
    narrow, wide = full_pool(16), full_pool(64)
    for slot in range(len(ADAPTERS)):
        for g, lay in wide.layouts.items():
            r = wide.rank(slot, g)
            assert narrow.rank(slot, g) == r and narrow.parts(slot, g) == wide.parts(slot, g)
            if r == 0:
                continue

            def a_t(pool, slot=slot, g=g, lay=lay):
                row = pool.A[0][g][slot]
                return torch.cat([row[off : off + lay.d_in * w].view(lay.d_in, w)
                                  for _, w, off in pool.a_tiles(slot, g)], dim=1)
            assert torch.equal(a_t(narrow), a_t(wide))
            for o0, o1, c0, c1, boff in wide.parts(slot, g):
                def bt(pool, width, o0=o0, o1=o1, c0=c0, c1=c1, boff=boff, slot=slot, g=g):
                    block = pool.B[0][g][slot][boff:]
                    return torch.cat([block[off : off + (o1 - o0) * w].view(o1 - o0, w)
                                      for _, w, off in b_strips(o1 - o0, c1 - c0, width)], 1)
                assert torch.equal(bt(narrow, 16), bt(wide, 64))
    assert [w for _, w, _ in a_tiles(120, 8, 16)] == [16] * 7 + [8]
    with pytest.raises(ValueError, match="tile_width"):
        LoraSlotPool(CFG, 1, MAX_RANK, tile_width=32)
    assert not sgmv_cpu.accepts_tile(KERNEL, 32)


@pytest.mark.parametrize("width", TILE_WIDTHS)
@pytest.mark.parametrize(("r", "rows", "d_out"), [(5, 8, 96), (8, 8, 64), (3, 16, 40), (7, 8, 7)])
def test_b_strips_are_written_as_laid_out(width, r, rows, d_out):
    # the strided copy of the full strips and the narrow last one equal the layout's
    # definition, strip by strip; rows past r keep what was there
    from loraserve.adapters.slot_pool import write_b_strips

    bt = torch.randn(r, d_out)
    block = torch.full((rows * d_out,), 7.0)
    write_b_strips(block, bt, rows, width)
    for s0, w, off in b_strips(rows, d_out, width):
        strip = block[off : off + rows * w].view(rows, w)
        assert torch.equal(strip[:r], bt[:, s0 : s0 + w])
        assert bool((strip[r:] == 7.0).all())
    B = torch.randn(d_out, r)  # a transposed view, as the pool passes B.T
    block.zero_()
    write_b_strips(block, B.T, rows, width)
    got = torch.cat([block[off : off + rows * w].view(rows, w)
                     for _, w, off in b_strips(rows, d_out, width)], 1)
    assert torch.equal(got[:r], B.T)
