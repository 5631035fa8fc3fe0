"""The LoRA op on a bfloat16 slot pool (lora_dtype="bfloat16") against the reference on the
same weights rounded to bf16: storage is bf16, arithmetic stays float32."""

from __future__ import annotations

import pytest
import torch
from test_lora_ops import ADAPTERS, CFG, KERNEL, MAX_RANK, check_all_groups, tile_cases

from loraserve.adapters.format import LoraAdapterWeights, LoraModuleWeights
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.lora import sgmv_cpu


def rounded_to_bf16(w: LoraAdapterWeights) -> LoraAdapterWeights:
    """The adapter as a bf16 pool holds it: every weight rounded to bfloat16 (B after its
    scale), then widened back; the arithmetic stays float32."""
    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()
    layers = tuple({m: LoraModuleWeights(A=r(mw.A), B=r(mw.B), rank=mw.rank, scale=mw.scale)
                    for m, mw in mods.items()} for mods in w.layers)
    return LoraAdapterWeights(w.path, w.rank, w.target_modules, layers, w.nbytes, w.fingerprint)


@pytest.mark.parametrize("path,tile", tile_cases())
def test_bf16_pool_equals_the_op_on_rounded_weights(path, tile):
    kernel = sgmv_cpu.load(torch.bfloat16)
    assert kernel is not None and kernel is not KERNEL
    if path == "kernel" and not sgmv_cpu.accepts_tile(kernel, tile):
        pytest.skip(f"this CPU's kernel build reads {sgmv_cpu.preferred_tile(kernel)}-wide tiles")
    pool = LoraSlotPool(CFG, len(ADAPTERS), MAX_RANK, dtype=torch.bfloat16, tile_width=tile)
    for s, w in enumerate(ADAPTERS):
        pool.write(s, w)
    assert pool.A[0]["qkv"].dtype == pool.B[0]["qkv"].dtype == torch.bfloat16
    seqs = [(8, 70), (None, 3), (4, 1), (0, 6), (5, 17), (1, 2), (2, 1), (3, 5), (6, 4), (7, 1)]
    check_all_groups(pool, seqs, [rounded_to_bf16(w) for w in ADAPTERS], seed=3, path=path,
                     kernel=kernel)
    # a float32 kernel on bf16 weights is refused: for their dtype, or first (an AVX-512
    # build on a 16-wide pool) for the pool's tile width
    why = "bfloat16" if sgmv_cpu.accepts_tile(KERNEL, tile) else "tile width"
    with pytest.raises(ValueError, match=why):
        check_all_groups(pool, [(0, 2)], ADAPTERS, path="kernel", kernel=KERNEL)
