"""The Triton element-wise kernels (ops/triton_elementwise.py) against the torch expressions
they replace on a GPU, under Triton's interpreter (tests/conftest.py) or on the GPU itself
(tests/gpu runs this file again). A single rounding (the residual add) is bit for bit; after
exp, a sum over the row or several roundings (rope), within two units in the last place of
the row's largest value. The interpreter converts float32 to bf16 by truncation, not to
nearest, so there the residual add too is within one unit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from loraserve.model.layers import RotaryEmbedding, apply_rope  # noqa: E402
from loraserve.model.rope import RopeScaling, inv_freq  # noqa: E402
from loraserve.ops import triton_elementwise as te  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Element-wise results that round as torch rounds: equal, but for the interpreter's bf16."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want)


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    """After exp, a sum over the row or several roundings: the last bits may move."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(want.dtype).eps
    if want.dtype == torch.float32:
        eps *= 8
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=2 * eps * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 96, 200])
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype, d):
    torch.manual_seed(d)
    h = torch.randn(5, d + 8).to(DEVICE, dtype)[:, :d]  # a row stride wider than the row
    r = torch.randn(5, d).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(d)).to(DEVICE, dtype)
    want_h = h.clone().add_(r, alpha=0.5)
    want = hf_rms_norm(want_h, w, 1e-6)
    got = te.add_rms_norm(h, r, 0.5, w, 1e-6)
    rounded_alike(h, want_h)  # the add, in place, rounds as torch's add_
    check(got, want)
    alone = te.add_rms_norm(want_h.clone(), None, 1.0, w, 1e-6)  # rms_norm alone
    check(alone, want)
    only_add = h.clone()
    assert te.add_rms_norm(only_add, r, 1.0, None, 1e-6) is only_add  # no weight: h itself
    rounded_alike(only_add, h + r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1500])
def test_silu_mul_is_silu_of_gate_times_up(dtype, inter):
    torch.manual_seed(inter)
    gu = (3 * torch.randn(4, 2 * inter)).to(DEVICE, dtype)
    gate, up = gu.split((inter, inter), dim=-1)
    want = F.silu(gate) * up
    got = te.silu_mul(gu, inter)
    check(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,kvh,hd", [(4, 2, 16), (3, 1, 12), (8, 8, 64)])
def test_rope_rotates_q_and_k_in_place_as_apply_rope(dtype, nh, kvh, hd):
    torch.manual_seed(hd)
    rope = RotaryEmbedding(inv_freq(hd, 10000.0, RopeScaling()), 64, dtype=dtype, device=DEVICE)
    qkv = torch.randn(6, (nh + 2 * kvh) * hd).to(DEVICE, dtype)
    qk = qkv[:, : (nh + kvh) * hd].reshape(-1, nh + kvh, hd)  # a view, as the model's
    positions = torch.tensor([0, 1, 5, 63, 17, 2], device=DEVICE)
    cos, sin = rope.tables(positions)
    want = apply_rope(qk, cos, sin)
    v_before = qkv[:, (nh + kvh) * hd :].clone()
    got = te.rope_(qk, positions, rope.cos, rope.sin)
    assert got.data_ptr() == qk.data_ptr()
    check(got, want)
    assert torch.equal(qkv[:, (nh + kvh) * hd :], v_before)  # v untouched


def test_empty_batches_launch_nothing():
    h = torch.empty(0, 8, device=DEVICE)
    assert te.add_rms_norm(h, h, 1.0, torch.ones(8, device=DEVICE), 1e-6).shape == (0, 8)
    assert te.silu_mul(torch.empty(0, 8, device=DEVICE), 4).shape == (0, 4)
    x = torch.empty(0, 2, 8, device=DEVICE)
    table = torch.ones(4, 8, device=DEVICE)
    assert te.rope_(x, torch.empty(0, dtype=torch.long, device=DEVICE), table, table) is x
