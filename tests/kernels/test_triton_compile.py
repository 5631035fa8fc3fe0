"""The Triton kernels compile for a GPU, checked on the CPU.

The rest of the suite runs them under Triton's interpreter, which does not type-check: a
paged-attention kernel that set `start = 0` (int32) and then `start = <int64 expression>` in a
branch passed every CPU test and failed to compile on the first real GPU (an H200), failing
every request. Here each kernel goes through Triton's front end (Python AST to TTIR, where
those checks live) for an sm_90 target, in a subprocess without TRITON_INTERPRET. No GPU,
driver or ptxas is needed for this stage. (The front end's entry points are internal: triton
is pinned in pyproject.toml.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import inspect, sys
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from loraserve.lora import triton_sgmv
from loraserve.model.attention.triton_paged import _kernels
from loraserve.ops import triton_elementwise as te

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
options = backend.parse_options({})


def ttir(kernel, types, constexprs):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types(n) for n in names}
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    codegen = backend.get_codegen_implementation(options)
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return src.make_ir(target, options, codegen, {}, ctx)


def typer(floats, dtype):
    def types(name):
        if name in floats:
            return "*" + dtype
        if name.endswith("_ptr"):
            return "*i64" if name in ("tiles_ptr", "tables_ptr", "blocks_ptr", "parts_ptr") \
                else "*fp32"
        return "fp32" if name in ("scale", "softcap") else "i64"
    return types


attention, _ = _kernels()
for dtype in ("fp32", "bf16", "fp16"):
    ttir(attention, typer({"q_ptr", "k_ptr", "v_ptr", "o_ptr"}, dtype),
         {"BLOCK_M": 16, "BLOCK_N": 32, "HD": 64,
          "PRECISION": "ieee" if dtype == "fp32" else "tf32"})
    for precision, native in (("ieee", False), ("tf32", False), ("tf32", dtype != "fp32")):
        for block_m in (16, 64):
            ttir(triton_sgmv.sgmv_shrink_kernel, typer({"x_ptr", "a_ptr"}, dtype),
                 {"BLOCK_M": block_m, "BLOCK_K": 128, "TILE": 64, "NATIVE": native,
                  "PRECISION": precision})
            for rank_block in (16, 64):
                ttir(triton_sgmv.sgmv_expand_kernel, typer({"y_ptr", "b_ptr"}, dtype),
                     {"BLOCK_M": block_m, "BLOCK_R": rank_block, "TILE": 64,
                      "PRECISION": precision, "STRIPS": 4})

    def elementwise(name, dtype=dtype):
        if name == "pos_ptr":
            return "*i64"
        if name.endswith("_ptr"):
            return "*" + dtype
        return "fp32" if name in ("alpha", "eps") else "i64"

    for has_r in (False, True):
        for has_w in (False, True):
            ttir(te.add_rms_norm_kernel, elementwise,
                 {"HAS_R": has_r, "HAS_W": has_w, "BLOCK": 2048})
    ttir(te.silu_mul_kernel, elementwise, {"BLOCK": 1024})
    ttir(te.rope_kernel, elementwise, {"HALF": 32, "HEADS": 64})
print("compiled")
"""


def test_every_triton_kernel_passes_the_gpu_front_end():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences 3.9's notice of a changing default
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
