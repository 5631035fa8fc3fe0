"""The projection fused with the LoRA expand (lora/gemm_expand_cpu.c, through the `cpu`
backend's `project`): bit for bit what the GEMM followed by the LoRA op gives, on mixed
batches of long segments, base rows, absent modules and ranks that differ by layer."""

from __future__ import annotations

import pytest
import torch
from test_lora_ops import ADAPTERS, CFG, full_pool

from loraserve.config import ModelConfig
from loraserve.lora import gemm_expand_cpu
from loraserve.lora.backends import cpu_kernel
from loraserve.lora.backends.base import LoraBackend
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend
from loraserve.model.linear import Linear
from loraserve.ops.gemm import gemm_backend

LIB = gemm_expand_cpu.load()
pytestmark = pytest.mark.skipif(LIB is None or gemm_backend() != "avx2",
                                reason="our GEMM is not this host's backend")


@pytest.fixture
def count_fused(monkeypatch):
    """How many projections took the fused path."""
    calls = []
    real = gemm_expand_cpu.gemm_expand

    def counting(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(gemm_expand_cpu, "gemm_expand", counting)
    return calls


def linears(cfg: ModelConfig, seed: int) -> dict[str, Linear]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, lay in full_pool().layouts.items() if cfg is CFG else ():
        out[name] = Linear(torch.randn(lay.d_out, lay.d_in, generator=g) / lay.d_in**0.5)
    return out


def both_ways(b: CpuKernelLoraBackend, seqs, seed: int):
    """(fused, separate) outputs of every layer and group for one batch."""
    plan = b.plan(seqs)
    n = sum(k for _, k in seqs)
    g = torch.Generator().manual_seed(seed)
    for layer in range(CFG.num_hidden_layers):
        for name, lin in linears(CFG, seed + layer).items():
            x = torch.randn(n, lin.in_features, generator=g)
            fused = b.project(plan, layer, name, x, lin)
            separate = LoraBackend.project(b, plan, layer, name, x, lin)
            yield name, fused, separate


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_equals_gemm_then_lora_op(count_fused, threads):
    b = CpuKernelLoraBackend(full_pool())
    assert b.fusable == {"qkv", "o", "gate_up", "down"}  # every test-model width is whole units
    # segments of 1..131 tokens (tile tails of every height), base rows between and at the
    # ends, every adapter (absent modules, layer-dependent ranks, two A tiles)
    seqs = [(None, 5), (8, 131), (4, 61), (None, 3), (0, 6), (5, 17), (1, 40), (2, 64),
            (3, 5), (6, 9), (7, 53), (None, 2)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, fused, separate in both_ways(b, seqs, seed=3):
            assert torch.equal(fused, separate), name
    finally:
        torch.set_num_threads(before)
    assert count_fused and all(count_fused)


def test_decode_batches_stay_unfused(count_fused):
    # a few tokens per adapter: the separate ops (the GEMM's tiles would be too short)
    b = CpuKernelLoraBackend(full_pool())
    seqs = [(s, 1) for s in range(len(ADAPTERS))] * 2
    for name, fused, separate in both_ways(b, seqs, seed=5):
        assert torch.equal(fused, separate), name
    assert not count_fused


def test_a_width_off_the_tile_unit_is_not_fused(count_fused):
    # gate_up of width 2 x 40: not whole tile units, so that group runs the two ops, and
    # gives what they give; down's outputs (64 wide) still fuse
    from loraserve.adapters.slot_pool import LoraSlotPool
    from loraserve.config import LORA_MODULES
    from test_lora_ops import make_adapter

    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=40, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    pool = LoraSlotPool(cfg, 1, 8)
    pool.write(0, make_adapter(1, 8, LORA_MODULES, cfg=cfg))
    b = CpuKernelLoraBackend(pool)
    assert b.fusable == {"qkv", "o", "down"}
    plan = b.plan([(0, 40)])
    for name in ("gate_up", "down"):
        lay = pool.layouts[name]
        lin = Linear(torch.randn(lay.d_out, lay.d_in))
        x = torch.randn(40, lay.d_in)
        got = b.project(plan, 0, name, x, lin)
        assert torch.equal(got, LoraBackend.project(b, plan, 0, name, x, lin))
    assert count_fused == [True]  # down only


def test_the_c_entry_refuses_a_misaligned_layout():
    # the C side checks too: a part whose columns are not whole units returns None
    x = torch.randn(4, 16)
    panels = torch.zeros(1, 16, 16)
    t = torch.zeros(4, 8)
    B = torch.zeros(1, 64)
    segs = torch.tensor([[0, 0, 4, 8]])
    parts = torch.tensor([[0, 0, 8, 0, 8, 0]])  # 8 columns: under one unit
    assert gemm_expand_cpu.gemm_expand(LIB, x, panels, 16, t, B, segs, parts, 64) is None


def test_fused_decode_shapes_are_exact_too(monkeypatch, count_fused):
    # the threshold is a speed choice: below it the fused path is exact as well
    monkeypatch.setattr(cpu_kernel, "FUSE_MIN_TOKENS", 1)
    b = CpuKernelLoraBackend(full_pool())
    seqs = [(s, 1) for s in range(len(ADAPTERS))]
    for name, fused, separate in both_ways(b, seqs, seed=9):
        assert torch.equal(fused, separate), name
    assert count_fused and all(count_fused)
