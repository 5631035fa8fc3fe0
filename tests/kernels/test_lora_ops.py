"""The segmented LoRA op (the `torch` and `cpu` (C kernel) backends) against the per-token
reference, and the tiny model, adapters and pools the other LoRA tests import from here. The
slot pool's invariants: test_lora_slot_pool.py; tests/test_lora_backends.py covers the
registry and fresh random batches through the ABC."""

from __future__ import annotations

import random

import pytest
import torch

from loraserve.adapters.format import LoraAdapterWeights, LoraModuleWeights
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.config import LORA_MODULES, ModelConfig
from loraserve.lora import sgmv_cpu
from loraserve.lora.backends import LORA_BACKENDS
from loraserve.lora.backends.torch_matmul import TorchLoraBackend
from loraserve.lora.batch import LoraBatch
from loraserve.lora.layout import MODULE_TO_GROUP, TILE_WIDTHS, group_layouts, padded_rank
from loraserve.lora.reference import lora_reference

KERNEL = sgmv_cpu.load()
# Every segment goes to the backend chosen at start: the torch matmuls or the C kernel (the
# engine no longer splits a batch between them by segment length).
PATHS = {"torch": "torch", "kernel": "cpu", "triton": "triton"}  # triton: interpreted


def backend(pool, path: str = "torch", kernel=None):
    b = LORA_BACKENDS[PATHS[path]](pool)
    if kernel is not None and path == "kernel":  # e.g. a kernel built for another dtype
        b.kernel = kernel
    return b


def apply_op(b, plan, layer: int, group: str, x, y):
    """The backend's op on one layer and group; returns y (unchanged without a plan)."""
    if plan is not None:
        b.apply(plan, layer, group, x, y)
    return y


CFG = ModelConfig(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
MAX_RANK = 64
ATOL = 1e-5


def make_adapter(seed: int, rank: int, modules, layer_ranks=None, alpha: float = 16.0, cfg=CFG):
    """Random adapter; layer_ranks[l] overrides the rank in layer l (0 = module absent)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for layer in range(cfg.num_hidden_layers):
        r = rank if layer_ranks is None else layer_ranks[layer]
        mods = {}
        for m in modules if r else ():
            d_out, d_in = cfg.module_shape(m)
            scale = alpha / r
            A = torch.randn(r, d_in, generator=g) / d_in**0.5
            B = torch.randn(d_out, r, generator=g) * scale
            mods[m] = LoraModuleWeights(A=A, B=B, rank=r, scale=scale)
        layers.append(mods)
    nbytes = sum(w.A.nbytes + w.B.nbytes for d in layers for w in d.values())
    return LoraAdapterWeights(
        f"mem://{seed}", rank, frozenset(modules), tuple(layers), nbytes, f"fp{seed}"
    )


ADAPTERS = [
    make_adapter(1, 4, LORA_MODULES),
    make_adapter(2, MAX_RANK, LORA_MODULES),  # a rank at the maximum
    make_adapter(3, 8, ("q_proj",)),
    make_adapter(4, 16, ("q_proj", "v_proj")),
    make_adapter(5, 33, ("k_proj", "o_proj", "up_proj")),
    make_adapter(6, 12, ("gate_proj", "down_proj")),
    make_adapter(7, 8, ("q_proj", "down_proj"), layer_ranks=[8, 24]),  # ranks differ by layer
    make_adapter(8, 8, ("up_proj", "v_proj"), layer_ranks=[0, 16]),  # layer 0 untouched
    make_adapter(9, 40, LORA_MODULES),  # packed qkv rank 120: two A.T tiles, the last padded
]


def full_pool(tile: int = 64) -> LoraSlotPool:
    pool = LoraSlotPool(CFG, len(ADAPTERS), MAX_RANK, tile_width=tile)
    for s, w in enumerate(ADAPTERS):
        pool.write(s, w)
    return pool


def check_all_groups(pool: LoraSlotPool, seqs, slot_weights, seed: int = 0,
                     path: str = "torch", kernel=None) -> None:
    """The backend's op == lora_reference for every layer and group of a batch of sequences."""
    b = backend(pool, path, kernel)
    plan = b.plan(seqs)
    batch = LoraBatch.build(seqs, pool)
    token_slots = batch.token_slots()
    g = torch.Generator().manual_seed(seed)
    for layer in range(CFG.num_hidden_layers):
        mods = [None if s < 0 else slot_weights[s].layers[layer] for s in token_slots]
        for name, lay in pool.layouts.items():
            x = torch.randn(batch.num_tokens, lay.d_in, generator=g)  # x: [T, d_in]
            y = torch.randn(batch.num_tokens, lay.d_out, generator=g)  # y: [T, d_out_g]
            want = lora_reference(x, y.clone(), mods, lay)
            got = apply_op(b, plan, layer, name, x, y.clone())
            torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


def test_c_kernel_builds_here():
    # The engine falls back to the torch path without a C compiler; these machines have one,
    # so a build failure here is a bug, not an environment to tolerate.
    assert KERNEL is not None


def tile_cases():
    # every backend reads 64-wide pools; the C kernel (AVX2 builds) and torch read 16 too
    return [(p, t) for p in PATHS for t in TILE_WIDTHS if t == 64 or p != "triton"]


@pytest.mark.parametrize("path,tile", tile_cases())
@pytest.mark.parametrize("seed", range(4))
def test_fast_op_matches_reference_on_mixed_batches(path, tile, seed):
    if path == "kernel" and not sgmv_cpu.accepts_tile(KERNEL, tile):
        pytest.skip(f"this CPU's kernel build reads {sgmv_cpu.preferred_tile(KERNEL)}-wide tiles")
    pool = full_pool(tile)
    rng = random.Random(seed)
    seqs = []
    for s in rng.sample(range(len(ADAPTERS)), len(ADAPTERS)):
        seqs += [(s, rng.choice([1, 1, 1, 7, 23]))] * rng.randint(1, 3)  # decodes and prefills
        if rng.random() < 0.5:
            seqs.append((None, rng.choice([1, 5])))  # base tokens as their own segments
    seqs.append((3, 2))  # slot 3 again, not adjacent to its first run
    check_all_groups(pool, seqs, ADAPTERS, seed, path)


@pytest.mark.parametrize("path,tile", tile_cases())
def test_long_segments_and_every_tile_shape(path, tile):
    # prefill-length segments (past the kernel's 60-token work chunks), token counts that
    # leave 1..5-token tails of the 6-token tiles, and every packed-rank width
    if path == "kernel" and not sgmv_cpu.accepts_tile(KERNEL, tile):
        pytest.skip(f"this CPU's kernel build reads {sgmv_cpu.preferred_tile(KERNEL)}-wide tiles")
    pool = full_pool(tile)
    seqs = [(8, 131), (None, 3), (4, 61), (0, 6), (5, 17), (1, 2), (2, 64), (3, 5), (6, 9),
            (7, 530)]  # past the kernel's 256-token expand chunks too
    check_all_groups(pool, seqs, ADAPTERS, seed=7, path=path)


@pytest.mark.parametrize("path,tile", tile_cases())
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_batch_of_many_adapters(path, tile, threads):
    # >= 4 short segments per thread: the kernel gives each thread whole segments (shrink, then
    # expand), heaviest first, with no barrier; base tokens sit between them
    if path == "kernel" and not sgmv_cpu.accepts_tile(KERNEL, tile):
        pytest.skip(f"this CPU's kernel build reads {sgmv_cpu.preferred_tile(KERNEL)}-wide tiles")
    pool = full_pool(tile)
    seqs = []
    for s in [8, 0, 3, 5, 1, 7, 2, 6, 4]:
        seqs += [(s, 1)] * (1 + s % 4) + [(None, 1)] * (s % 2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_all_groups(pool, seqs, ADAPTERS, seed=11, path=path)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("slots", [[0, 1, 8], [0, 8, 2, 0, 8]])  # one heavy adapter; even ones
def test_few_decode_segments_give_the_same_bits_on_any_thread_count(slots):
    # a few short segments: on one thread, or where no segment outweighs a thread's share,
    # each thread takes whole segments; a heavy one among light ones is split into items.
    # Either way each y element is its sum in the same order: the same bits.
    pool = full_pool(sgmv_cpu.preferred_tile(KERNEL))
    seqs = [(s, 1) for s in slots for _ in range(3)]
    b = backend(pool, "kernel")
    plan = b.plan(seqs)
    g = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    try:
        for name, lay in pool.layouts.items():
            x = torch.randn(len(seqs), lay.d_in, generator=g)
            y = torch.randn(len(seqs), lay.d_out, generator=g)
            outs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs.append(apply_op(b, plan, 1, name, x, y.clone()))
            assert all(torch.equal(o, outs[0]) for o in outs[1:]), name
    finally:
        torch.set_num_threads(before)
    torch.set_num_threads(2)
    try:
        check_all_groups(pool, seqs, ADAPTERS, seed=13, path="kernel")
    finally:
        torch.set_num_threads(before)


def test_base_only_batch_leaves_y_unchanged():
    pool = full_pool()
    seqs = [(None, 4), (-1, 3), (None, 1)]
    batch = LoraBatch.build(seqs, pool)
    assert batch.is_empty and batch.num_tokens == 8
    for path in PATHS:
        assert backend(pool, path).plan(seqs) is None  # base-only: no LoRA work at all
    # an adapter targeting only q_proj makes no plan for the other groups: no work there
    for path in PATHS:
        b = backend(pool, path)
        only_q = b.plan([(2, 4), (None, 4)])
        assert set(only_q.groups) == {"qkv"}
        y = torch.randn(8, pool.layouts["o"].d_out)
        before = y.clone()
        assert apply_op(b, only_q, 0, "o", torch.randn(8, pool.layouts["o"].d_in), y) is y
        assert torch.equal(y, before)


def test_per_module_delta_equals_scaled_BA():
    pool = full_pool()
    lays = group_layouts(CFG)
    for s, w in enumerate(ADAPTERS):
        for layer, mods in enumerate(w.layers):
            for m in LORA_MODULES:
                g = MODULE_TO_GROUP[m]
                lay = lays[g]
                k = lay.modules.index(m)
                c0, d_out = lay.col_offsets[k], lay.d_outs[k]
                x = torch.eye(lay.d_in)  # one token per input basis vector: y = delta.T
                b = backend(pool)
                y = apply_op(b, b.plan([(s, lay.d_in)]), layer, g, x,
                             torch.zeros(lay.d_in, lay.d_out))
                delta = y[:, c0 : c0 + d_out].T  # delta: [d_out, d_in]
                if m in mods:
                    mw = mods[m]
                    unscaled = mw.B / mw.scale
                    torch.testing.assert_close(
                        delta, mw.scale * unscaled @ mw.A, atol=ATOL, rtol=1e-5
                    )
                else:
                    assert not delta.any(), (s, layer, m)


def test_cost_follows_packed_rank_not_max_rank():
    pool = full_pool()
    torch_plan = TorchLoraBackend(pool).plan([(0, 2), (3, 1), (2, 1)])
    batch = torch_plan.batch
    r0 = {"qkv": 12, "o": 4, "gate_up": 8, "down": 4}
    assert batch.ranks[0] == r0
    assert batch.ranks[3] == {"qkv": 32, "o": 0, "gate_up": 0, "down": 0}
    for g, plan in torch_plan.groups.items():
        for _xs, tiles, parts in plan:
            slot = tiles[0][0][0]
            views = [pool.A[0][g][idx].view(shape) for idx, shape in tiles]
            # the tiles cover the packed rank padded to whole vectors, and nothing more
            assert sum(v.shape[1] for v in views) == padded_rank(batch.ranks[slot][g])
            assert all(v.shape[0] == pool.layouts[g].d_in for v in views)
            assert views[0].data_ptr() == pool.A[0][g][slot].data_ptr()  # a view, not a copy
            for _, _, b_idx, (rows, cols) in parts:
                assert rows <= batch.ranks[slot][g]
                assert pool.B[0][g][b_idx].numel() == rows * cols  # exactly the module's block
