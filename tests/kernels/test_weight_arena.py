"""ops/weight_arena.py: packed weights one after another in shared 2 MB-page chunks, each on a
cache line of its own, alive as long as any view of their chunk."""

from __future__ import annotations

import gc

import pytest
import torch

from loraserve.ops.weight_arena import ALIGN, WeightArena


def test_tensors_follow_each_other_on_cache_lines_in_one_chunk():
    arena = WeightArena(chunk_bytes=1 << 20)
    a = arena.empty(3, 5, dtype=torch.float32)  # 60 bytes: the next starts a line later
    b = arena.empty(100, dtype=torch.uint8)
    c = arena.empty(7, 16, dtype=torch.float16)
    assert a.shape == (3, 5) and b.shape == (100,) and c.shape == (7, 16)
    assert all(t.is_contiguous() for t in (a, b, c))
    assert b.data_ptr() - a.data_ptr() == ALIGN
    assert c.data_ptr() - b.data_ptr() == 2 * ALIGN
    assert all(t.data_ptr() % ALIGN == 0 for t in (a, b, c))
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()  # one chunk


def test_a_full_chunk_starts_another_and_large_tensors_get_their_own():
    arena = WeightArena(chunk_bytes=4096)
    first = arena.empty(3000, dtype=torch.uint8)
    second = arena.empty(3000, dtype=torch.uint8)  # does not fit the first chunk's rest
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    big = arena.empty(2048, dtype=torch.float32)  # a chunk's size: an allocation of its own
    after = arena.empty(16, dtype=torch.uint8)
    assert after.data_ptr() - second.data_ptr() == 3008  # the chunk in use goes on
    assert big.numel() == 2048 and arena.empty(0, 4, dtype=torch.float32).shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
def test_copy_keeps_the_values_of_any_layout(dtype):
    arena = WeightArena(chunk_bytes=1 << 16)
    src = (torch.arange(96) % 50).to(dtype).view(8, 12).t()  # not contiguous
    out = arena.copy(src)
    assert out.is_contiguous() and out.dtype == dtype and torch.equal(out, src)


def test_a_chunk_lives_while_any_of_its_views_does():
    arena = WeightArena(chunk_bytes=1 << 16)
    kept = arena.empty(64, dtype=torch.float32).fill_(3.0)
    dropped = arena.empty(64, dtype=torch.float32)
    arena._chunk = None  # the arena moves on: only the views hold the chunk now
    del dropped
    gc.collect()
    others = [arena.empty(4096, dtype=torch.float32).fill_(-1.0) for _ in range(8)]
    assert torch.all(kept == 3.0) and all(torch.all(o == -1.0) for o in others)


def test_packed_weights_of_both_kinds_go_one_after_another(monkeypatch):
    # a model packs its projections in forward order: a decode step reads one long run
    from loraserve.ops import gemm, qpanel
    from loraserve.ops import quant_formats as qf
    from loraserve.ops.gemm import pack_panels as pack_float32
    from loraserve.ops.qpanel import pack_panels as pack_quantized

    arena = WeightArena()  # the process's own may be at the end of a chunk
    monkeypatch.setattr(gemm, "PACKED_WEIGHTS", arena)
    monkeypatch.setattr(qpanel, "PACKED_WEIGHTS", arena)
    w = torch.randn(48, 64)
    first = pack_float32(w)
    quant = pack_quantized(qf.quantize_int8(w))
    after = pack_float32(w)
    assert quant.w.data_ptr() == first.data_ptr() + first.nbytes
    assert quant.d.data_ptr() == quant.w.data_ptr() + quant.w.nbytes
    assert after.data_ptr() == quant.d.data_ptr() + -(-quant.d.nbytes // ALIGN) * ALIGN


def test_a_weight_that_is_not_a_models_takes_no_arena_space(monkeypatch):
    from loraserve.ops import gemm

    arena = WeightArena()
    monkeypatch.setattr(gemm, "PACKED_WEIGHTS", arena)
    w = torch.randn(40, 64)
    probe = gemm.pack_panels(w, model_weight=False)
    assert arena._chunk is None and arena._used == 0
    assert torch.equal(gemm.unpack_panels(probe, 40), w)
