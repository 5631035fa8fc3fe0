"""The projection fused with the LoRA op (lora/gemm_lora_cpu.py, through the `cpu` backend's
`project`): bit for bit what the GEMM followed by the LoRA op gives, for prefill-length
segments (the expand in the GEMM's tiles) and decode batches (shrink and expand interleaved
with the GEMM), on mixed batches of base rows, absent modules and ranks that differ by
layer."""

from __future__ import annotations

import pytest
import torch
from test_lora_ops import ADAPTERS, CFG, full_pool, make_adapter

from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.config import LORA_MODULES, ModelConfig
from loraserve.lora import gemm_lora_cpu
from loraserve.lora.backends import cpu_kernel
from loraserve.lora.backends.base import LoraBackend
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend
from loraserve.model.linear import Linear
from loraserve.ops.gemm import gemm_backend

EXPAND, DECODE = gemm_lora_cpu.load_expand(), gemm_lora_cpu.load_decode()
pytestmark = pytest.mark.skipif(EXPAND is None or DECODE is None or gemm_backend() != "avx2",
                                reason="our GEMM is not this host's backend")


@pytest.fixture
def fused_calls(monkeypatch):
    """name of each fused entry -> whether each call ran fused (not refused)."""
    calls: dict[str, list[bool]] = {"gemm_expand": [], "gemm_lora_decode": []}
    real_expand, real_decode = gemm_lora_cpu.gemm_expand, gemm_lora_cpu.DecodeCall.__call__

    def expand(*a, **k):
        out = real_expand(*a, **k)
        calls["gemm_expand"].append(out is not None)
        return out

    def decode(*a, **k):
        out = real_decode(*a, **k)
        calls["gemm_lora_decode"].append(out is not None)
        return out

    monkeypatch.setattr(gemm_lora_cpu, "gemm_expand", expand)
    monkeypatch.setattr(gemm_lora_cpu.DecodeCall, "__call__", decode)
    return calls


def both_ways(b: CpuKernelLoraBackend, seqs, seed: int, cfg: ModelConfig = CFG):
    """(group, fused, separate) for every layer and group of one batch."""
    plan = b.plan(seqs)
    n = sum(k for _, k in seqs)
    g = torch.Generator().manual_seed(seed)
    for layer in range(cfg.num_hidden_layers):
        for name, lay in b.weights.layouts.items():
            lin = Linear(torch.randn(lay.d_out, lay.d_in, generator=g) / lay.d_in**0.5)
            x = torch.randn(n, lin.in_features, generator=g)
            fused = b.project(plan, layer, name, x, lin)
            separate = LoraBackend.project(b, plan, layer, name, x, lin)
            yield name, fused, separate


def assert_exact(b, seqs, seed, threads=2):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, fused, separate in both_ways(b, seqs, seed):
            assert torch.equal(fused, separate), name
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_segments_fused_equal_gemm_then_lora_op(fused_calls, threads):
    b = CpuKernelLoraBackend(full_pool())
    b.fuse_prefill = True  # AVX2 builds run the two ops here (slower fused): test it anyway
    assert b.fusable == {"qkv", "o", "gate_up", "down"}  # every test-model width is whole units
    # segments of 17..131 tokens (tile tails of every height), base rows between and at the
    # ends, every adapter (absent modules, layer-dependent ranks, two A tiles)
    seqs = [(None, 5), (8, 131), (4, 61), (None, 3), (0, 26), (5, 17), (1, 40), (2, 64),
            (3, 25), (6, 19), (7, 53), (None, 2)]
    assert_exact(b, seqs, seed=3, threads=threads)
    assert fused_calls["gemm_expand"] and all(fused_calls["gemm_expand"])
    assert not fused_calls["gemm_lora_decode"]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_batches_fused_equal_gemm_then_lora_op(fused_calls, threads):
    # a few tokens per adapter, base tokens between them: the interleaved op, which splits
    # the columns and the shrinks between however many threads run it
    b = CpuKernelLoraBackend(full_pool())
    seqs = []
    for s in [8, 0, 3, 5, 1, 7, 2, 6, 4]:
        seqs += [(s, 1)] * (1 + s % 4) + [(None, 1)] * (s % 2)
    assert_exact(b, seqs, seed=5, threads=threads)
    assert fused_calls["gemm_lora_decode"] and all(fused_calls["gemm_lora_decode"])
    assert not fused_calls["gemm_expand"]


@pytest.mark.parametrize("tokens", [12, 24, 64])
def test_decode_batch_sizes_of_each_panel_fetch_way_are_exact(fused_calls, tokens):
    # the next unit's panels are fetched by the first row tile alone (12 tokens: two tiles of
    # 8 rows) or spread over the first tiles with the adapters' lines in the later ones
    b = CpuKernelLoraBackend(full_pool())
    seqs = [(s % len(ADAPTERS), 1) for s in range(tokens)]
    assert_exact(b, sorted(seqs), seed=11)
    assert fused_calls["gemm_lora_decode"] and all(fused_calls["gemm_lora_decode"])


def test_one_decode_plan_serves_every_layer_whatever_the_thread_count(fused_calls):
    # the C side makes its work plan at a step's first call of a group and reuses it for the
    # other layers; a call with another thread count gets a new plan, and stays exact
    b = CpuKernelLoraBackend(full_pool())
    seqs = [(s, 1 + s % 3) for s in range(len(ADAPTERS))] + [(None, 2)]
    before = torch.get_num_threads()
    threads = iter([2, 1, 3, 2, 2, 1, 3, 3])
    try:
        for name, fused, separate in both_ways(b, seqs, seed=8):
            assert torch.equal(fused, separate), name
            torch.set_num_threads(next(threads, 2))
    finally:
        torch.set_num_threads(before)
    assert len(fused_calls["gemm_lora_decode"]) == 4 * CFG.num_hidden_layers
    assert all(fused_calls["gemm_lora_decode"])


def test_long_segments_fuse_where_the_build_is_faster():
    # AVX-512 builds fuse the expand into the tiles; AVX2 builds run the two ops (measured
    # slower fused there, gemm_expand_cpu.c)
    b = CpuKernelLoraBackend(full_pool())
    assert b.fuse_prefill == (gemm_lora_cpu.unit(EXPAND) == 32)


def test_one_decode_token_and_one_adapter(fused_calls):
    b = CpuKernelLoraBackend(full_pool())
    assert_exact(b, [(1, 1)], seed=6)
    assert_exact(b, [(None, 3), (8, 2)], seed=7)
    assert all(fused_calls["gemm_lora_decode"])


def test_below_the_threshold_either_fused_path_is_exact(monkeypatch, fused_calls):
    # the threshold is a speed choice: decode shapes through the tile epilogue are exact too
    monkeypatch.setattr(cpu_kernel, "FUSE_MIN_TOKENS", 1)
    b = CpuKernelLoraBackend(full_pool())
    b.fuse_prefill = True
    assert_exact(b, [(s, 1) for s in range(len(ADAPTERS))], seed=9)
    assert fused_calls["gemm_expand"] and all(fused_calls["gemm_expand"])


def test_a_width_off_the_tile_unit_is_not_fused(fused_calls):
    # gate_up of width 2 x 40: not whole tile units, so that group runs the two ops (with
    # the same results); down's outputs (64 wide) still fuse
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=40, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    pool = LoraSlotPool(cfg, 1, 8)
    pool.write(0, make_adapter(1, 8, LORA_MODULES, cfg=cfg))
    b = CpuKernelLoraBackend(pool)
    b.fuse_prefill = True
    assert b.fusable == {"qkv", "o", "down"}
    for seqs in ([(0, 40)], [(0, 2)]):
        plan = b.plan(seqs)
        n = seqs[0][1]
        for name in ("gate_up", "down"):
            lay = pool.layouts[name]
            lin = Linear(torch.randn(lay.d_out, lay.d_in))
            x = torch.randn(n, lay.d_in)
            got = b.project(plan, 0, name, x, lin)
            assert torch.equal(got, LoraBackend.project(b, plan, 0, name, x, lin))
    assert fused_calls == {"gemm_expand": [True], "gemm_lora_decode": [True]}  # down only


def test_the_c_entries_refuse_a_misaligned_layout():
    # the C side checks too: a part whose columns are not whole units is refused (None)
    x = torch.randn(4, 16)
    panels = torch.zeros(1, 16, 16)
    A, B = torch.zeros(1, 8 * 16), torch.zeros(1, 64)
    segs = torch.tensor([[0, 0, 4, 8]])
    parts = torch.tensor([[0, 0, 8, 8, 16, 0]])  # columns 8..16: off the unit and strip grid
    assert gemm_lora_cpu.gemm_expand(EXPAND, x, panels, 16, A, B, segs, parts, 8, 64) is None
    decode = gemm_lora_cpu.DecodeCall(DECODE, segs, parts, 8, 4, 64)
    assert decode(x, panels, 16, A, B) is None


def test_engine_tokens_are_the_same_with_the_fused_ops_off(tiny_model_dir, tmp_path,
                                                          monkeypatch, fused_calls):
    # Through the engine: prompts of 1..60 tokens over three adapters and the base model
    # (prefill steps take the expand-in-tiles path, decode steps the interleaved one); the
    # tokens equal those of the projection-then-LoRA path exactly
    from adapter_factory import make_peft_adapter

    from loraserve import LLM, SamplingParams

    paths = {f"a{r}": str(make_peft_adapter(tiny_model_dir, tmp_path / f"a{r}", r=r,
                                            target_modules=list(LORA_MODULES), seed=r))
             for r in (4, 16, 64)}
    names = [*paths, None]
    prompts = [[(7 * i + j) % 500 + 3 for j in range(1 + (13 * i) % 60)] for i in range(16)]
    loras = [names[i % len(names)] for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(gemm_lora_cpu, "expand_preferred", lambda lib: True)  # AVX2 too

    def run():
        llm = LLM(str(tiny_model_dir), lora_paths=paths, max_lora_rank=64)
        return [o.token_ids for o in llm.generate(prompts, params, lora=loras)]

    fused = run()
    assert any(fused_calls["gemm_expand"]) and any(fused_calls["gemm_lora_decode"])
    monkeypatch.setattr(CpuKernelLoraBackend, "project", LoraBackend.project)
    assert run() == fused


@pytest.mark.parametrize("tokens_each", [1, 3, 40])
def test_wider_model_is_exact(tokens_each, monkeypatch, fused_calls):
    # wider than the test model: several GEMM column units and B strips per thread, modules
    # of 2-5 strips, one thread's columns ending inside a module
    cfg = ModelConfig(vocab_size=32, hidden_size=256, intermediate_size=640,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64)
    pool = LoraSlotPool(cfg, 5, 64)
    for s, (r, mods) in enumerate([(8, LORA_MODULES), (64, LORA_MODULES), (16, ("k_proj",)),
                                   (32, ("gate_proj", "down_proj", "o_proj")),
                                   (24, ("q_proj", "up_proj"))]):
        pool.write(s, make_adapter(40 + s, r, mods, cfg=cfg))
    b = CpuKernelLoraBackend(pool)
    b.fuse_prefill = True
    seqs = [(None, 2)] + [(s, tokens_each) for s in (3, 0, 4, 1, 2)] + [(None, 1)]
    plan = b.plan(seqs)
    n = sum(k for _, k in seqs)
    g = torch.Generator().manual_seed(tokens_each)
    for name, lay in pool.layouts.items():
        lin = Linear(torch.randn(lay.d_out, lay.d_in, generator=g) / lay.d_in**0.5)
        x = torch.randn(n, lay.d_in, generator=g)
        got = b.project(plan, 0, name, x, lin)
        assert torch.equal(got, LoraBackend.project(b, plan, 0, name, x, lin)), name
    assert all(fused_calls["gemm_expand"] + fused_calls["gemm_lora_decode"])
    assert len(fused_calls["gemm_expand"] + fused_calls["gemm_lora_decode"]) == 4
