"""Every registered LoRA backend against the plain reference, through the LoraBackend ABC only
(fresh random inputs, mixed ranks 4..64, empty segments, base rows between adapter rows), and
the registry: chosen once by name, unknown names refused, the C kernel's fallback."""

from __future__ import annotations

import random

import pytest
import torch
from test_lora_ops import CFG, MAX_RANK, make_adapter

from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.config import LORA_MODULES
from loraserve.lora import sgmv_cpu
from loraserve.lora.backends import (
    LORA_BACKENDS,
    LoraBackend,
    create_lora_backend,
    pool_tile_width,
)
from loraserve.lora.batch import LoraBatch
from loraserve.lora.reference import lora_reference


def random_pool(rng: random.Random, tile: int = 64):
    """Six adapters of random ranks in 4..64 on random module subsets, one slot left empty."""
    adapters = []
    for _ in range(6):
        mods = rng.sample(LORA_MODULES, rng.randint(1, len(LORA_MODULES)))
        adapters.append(make_adapter(100 + rng.randrange(10**6), rng.randint(4, MAX_RANK), mods))
    pool = LoraSlotPool(CFG, len(adapters) + 1, MAX_RANK, tile_width=tile)
    for s, w in enumerate(adapters):
        pool.write(s, w)
    return pool, adapters


@pytest.mark.parametrize("name", sorted(LORA_BACKENDS))
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tile", [16, 64])
def test_backend_equals_reference_through_the_abc(name, seed, tile):
    rng = random.Random(seed)
    pool, adapters = random_pool(rng, tile)
    lib = sgmv_cpu.load()
    if name == "triton" and tile != 64 or name == "cpu" and not sgmv_cpu.accepts_tile(lib, tile):
        with pytest.raises(ValueError, match="tile width"):
            create_lora_backend(pool, name)  # refused, never read in the wrong layout
        return
    backend = create_lora_backend(pool, name)
    assert isinstance(backend, LoraBackend) and backend.name == name
    seqs = []
    for _ in range(14):
        kind = rng.random()
        if kind < 0.2:
            seqs.append((None, rng.choice([1, 3])))  # base rows between adapter rows
        elif kind < 0.3:
            seqs.append((rng.randrange(len(adapters)), 0))  # an empty segment
        else:
            seqs.append((rng.randrange(len(adapters)), rng.choice([1, 1, 2, 9, 33])))
    plan = backend.plan(seqs)
    token_slots = LoraBatch.build(seqs, pool).token_slots()
    g = torch.Generator().manual_seed(seed)
    for layer in range(CFG.num_hidden_layers):
        mods = [None if s < 0 else adapters[s].layers[layer] for s in token_slots]
        for group, lay in pool.layouts.items():
            x = torch.randn(len(token_slots), lay.d_in, generator=g)  # x: [T, d_in]
            y = torch.randn(len(token_slots), lay.d_out, generator=g)  # y: [T, d_out_g]
            want = lora_reference(x, y.clone(), mods, lay)
            got = y.clone()
            backend.apply(plan, layer, group, x, got)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            base = [t for t, s in enumerate(token_slots) if s < 0]
            assert torch.equal(got[base], y[base]), "a base row changed"


@pytest.mark.parametrize("name", sorted(LORA_BACKENDS))
def test_base_only_batch_has_no_plan(name):
    pool, _ = random_pool(random.Random(5))
    backend = create_lora_backend(pool, name)
    assert backend.plan([(None, 3), (-1, 2)]) is None
    assert backend.plan([(6, 4)]).groups == {}  # an empty slot touches no group


def test_registry_by_name_env_and_errors(monkeypatch):
    pool, _ = random_pool(random.Random(6))
    monkeypatch.delenv("LORASERVE_LORA_BACKEND", raising=False)
    assert create_lora_backend(pool).name == "cpu"  # the default where gcc exists
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "torch")
    assert create_lora_backend(pool).name == "torch"
    assert create_lora_backend(pool, "cpu").name == "cpu"  # an explicit name wins
    with pytest.raises(ValueError, match="unknown LoRA backend 'punica'.*'cpu', 'torch', 'triton'"):
        create_lora_backend(pool, "punica")


def test_triton_on_a_cpu_without_the_interpreter_is_refused_not_replaced(monkeypatch):
    pool, _ = random_pool(random.Random(8))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton LoRA backend needs a CUDA device"):
        create_lora_backend(pool, "triton")


def test_cpu_falls_back_to_torch_without_a_compiler(monkeypatch, tmp_path, caplog):
    pool, _ = random_pool(random.Random(7))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setattr(sgmv_cpu, "_libs", {})  # forget the kernels this process built
    with caplog.at_level("WARNING"):
        backend = create_lora_backend(pool, "cpu")
    assert backend.name == "torch"
    assert "C LoRA kernel" in caplog.text and "torch" in caplog.text


def test_pool_tile_width_follows_the_backend_that_will_run(monkeypatch):
    # The engine lays its slot pool out for the backend it is about to create: the C kernel's
    # preferred width (16 on AVX2 builds, 64 on AVX-512), 64 for torch, triton and any GPU.
    monkeypatch.delenv("LORASERVE_LORA_BACKEND", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native = sgmv_cpu.preferred_tile(sgmv_cpu.load())
    assert native in (16, 64)
    assert pool_tile_width(None, torch.float32, cpu) == native
    assert pool_tile_width("cpu", torch.bfloat16, cpu) == native
    assert pool_tile_width("torch", torch.float32, cpu) == 64
    assert pool_tile_width("triton", torch.float32, cpu) == 64
    assert pool_tile_width(None, torch.float32, cuda) == 64
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "torch")
    assert pool_tile_width(None, torch.float32, cpu) == 64


@pytest.mark.parametrize("rank_block", [16, 64])
@pytest.mark.parametrize("strips", [2, 4])
def test_triton_expand_strips_per_program_change_no_bit(monkeypatch, strips, rank_block):
    """More 64-column strips per expand program (fewer programs in a replayed graph's worst-case
    grid, each strip's columns in the same product) computes each sum exactly as one strip per
    program does, at either step of
    the reduction over the rank; and every step matches the reference."""
    from loraserve.lora import triton_sgmv

    monkeypatch.setattr(triton_sgmv, "EXPAND_RANK_BLOCK", rank_block)
    rng = random.Random(7)
    pool, adapters = random_pool(rng)
    backend = create_lora_backend(pool, "triton")
    seqs = [(0, 3), (None, 2), (1, 9), (4, 1), (5, 17)]
    plan = backend.plan(seqs)
    token_slots = LoraBatch.build(seqs, pool).token_slots()
    g = torch.Generator().manual_seed(1)
    for group, lay in pool.layouts.items():
        x = torch.randn(len(token_slots), lay.d_in, generator=g)
        y = torch.randn(len(token_slots), lay.d_out, generator=g)
        mods = [None if s < 0 else adapters[s].layers[0] for s in token_slots]
        want = lora_reference(x, y.clone(), mods, lay)
        outs = []
        for n in (1, strips):
            monkeypatch.setattr(triton_sgmv, "EXPAND_STRIPS", n)
            got = y.clone()
            backend.apply(plan, 0, group, x, got)
            outs.append(got)
        assert torch.equal(outs[0], outs[1]), group
        torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)


def test_triton_long_segments_take_bigger_blocks_with_the_same_sums(monkeypatch):
    """Prompt-long segments go LONG_BLOCK_M tokens a program (each tile read once per 64 rows);
    a step of decodes keeps BLOCK_M; both match the reference."""
    from loraserve.lora import triton_sgmv

    rng = random.Random(11)
    pool, adapters = random_pool(rng)
    backend = create_lora_backend(pool, "triton")
    assert triton_sgmv.rows_per_program([1, 3, 2]) == triton_sgmv.BLOCK_M
    long_seqs = [(0, 70), (None, 5), (2, 130), (3, 64)]
    plan = backend.plan(long_seqs)
    assert {data[4] for data in plan.groups.values()} == {triton_sgmv.LONG_BLOCK_M}
    token_slots = LoraBatch.build(long_seqs, pool).token_slots()
    g = torch.Generator().manual_seed(3)
    for group, lay in pool.layouts.items():
        if group not in plan.groups:
            continue
        x = torch.randn(len(token_slots), lay.d_in, generator=g)
        y = torch.randn(len(token_slots), lay.d_out, generator=g)
        mods = [None if s < 0 else adapters[s].layers[0] for s in token_slots]
        want = lora_reference(x, y.clone(), mods, lay)
        got = y.clone()
        backend.apply(plan, 0, group, x, got)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_triton_expand_rank_step_follows_the_pool_not_the_batch(monkeypatch):
    from loraserve.lora import triton_sgmv

    monkeypatch.setattr(triton_sgmv, "EXPAND_RANK_BLOCK", 64)
    assert [triton_sgmv.rank_block(r) for r in (4, 16, 24, 64, 256)] == [16, 16, 32, 64, 64]
