"""bfloat16 weights on CPU: oneDNN's bf16 matmul (AVX-512 BF16 / AMX where the CPU has them)
with float32 accumulation, on float32 activations rounded to bf16 at its input.

Whether it pays is decided once per process by trying it (`bf16_speed`): a float32 and a bf16
product of the same shape, timed alternately on one core, on the GEMMs the model would run.
Where the bf16 one is much the slower (a CPU without bf16 dot products: oneDNN then widens in
software), `require_fast_bf16` refuses bf16 weights with the measured figure and points at
float32, rather than serve them several times slower; where oneDNN has no bf16 matmul for the
CPU at all (AVX2 without AVX-NE-CONVERT), it refuses them saying so.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from loraserve.ops.gemm import PACK_BATCH_HINT, gemm_backend, pack_panels, panel_linear

log = logging.getLogger("loraserve.ops")

# The probe's product: rows x d_in -> d_out, a batched-decode step's size on a small model's
# projection (large enough that the timing is the GEMM's, small enough to take milliseconds).
PROBE_ROWS, PROBE_DIN, PROBE_DOUT = 64, 1024, 2048
PROBE_ROUNDS = 9
# Below this bf16 / float32 rate bf16 weights are refused: a CPU with bf16 instructions runs
# them faster than float32 at this size, one without runs them several times slower, so the
# line falls far from both and host noise cannot move a CPU across it.
MIN_SPEED = 0.5


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A `[d_out, d_in]` weight rounded to bf16 (round to nearest even, as `.to` does) in
    oneDNN's blocked layout, for `bf16_linear`."""
    w = weight.detach().to(torch.bfloat16).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """float32 `[T, d_in]` -> float32 `[T, d_out]`: x rounded to bf16, products summed in
    float32 by oneDNN, the sums rounded to bf16 (oneDNN's output takes its input's type
    through torch) and widened back."""
    y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")
    return y.to(torch.float32)


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """The plain bf16 `[d_out, d_in]` weight back from `pack_bf16` (a copy)."""
    return packed.to_dense()


def _float32_product(weight: torch.Tensor):
    """The model's float32 projection on `weight`, as model/linear.Linear would run it."""
    if gemm_backend() == "avx2":
        panels = pack_panels(weight, model_weight=False)  # the probe's: gone after it
        return lambda x: panel_linear(x, panels, weight.shape[0])
    if gemm_backend() == "onednn":
        from loraserve.ops.gemm import onednn_linear, pack_weight

        packed = pack_weight(weight)
        return lambda x: onednn_linear(x, packed)
    wt = weight.t().contiguous()
    return lambda x: torch.mm(x, wt)


@functools.lru_cache(maxsize=1)
def bf16_speed() -> float:
    """bf16 matmul rate / float32 rate on one core of this CPU, measured now; 0.0 where
    oneDNN has no bf16 matmul here at all. One thread and the fastest of several rounds of
    each: other processes on the host only ever slow a round down, and a multi-threaded
    product waits for its slowest thread."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(PROBE_DOUT, PROBE_DIN, generator=g)
    x = torch.randn(PROBE_ROWS, PROBE_DIN, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        f32 = _float32_product(weight)
        try:
            packed = pack_bf16(weight)
            bf16_linear(x, packed)
        except RuntimeError as e:
            log.warning("oneDNN has no bf16 matmul on this CPU: %s", e)
            return 0.0
        best_f32 = best_bf16 = float("inf")
        for _ in range(PROBE_ROUNDS):
            t0 = time.perf_counter()
            f32(x)
            t1 = time.perf_counter()
            bf16_linear(x, packed)
            t2 = time.perf_counter()
            best_f32, best_bf16 = min(best_f32, t1 - t0), min(best_bf16, t2 - t1)
    finally:
        torch.set_num_threads(threads)
    return best_f32 / max(best_bf16, 1e-9)


def require_fast_bf16() -> float:
    """The measured bf16 / float32 speed; a ValueError naming it where bf16 is refused."""
    speed = bf16_speed()
    if speed < MIN_SPEED:
        what = ("has no bf16 matmul" if speed == 0.0 else
                f"computes bf16 weights at {speed:.2f}x the float32 rate (measured at load: "
                "no bf16 dot-product instructions)")
        raise ValueError(f"dtype bfloat16 on CPU: this CPU {what}; serve with --dtype float32")
    log.info("bf16 weights: oneDNN's bf16 matmul runs at %.2fx the float32 rate here", speed)
    return speed
