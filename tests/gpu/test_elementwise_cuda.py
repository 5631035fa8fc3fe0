"""The Triton element-wise kernels compiled for the GPU (not interpreted), against the torch
expressions they replace: the kernel cases of tests/kernels/test_triton_elementwise.py run
again here, where bf16 rounds to nearest as it does on the GPU."""

from __future__ import annotations

from test_triton_elementwise import (  # noqa: F401  (collected here again, on the GPU)
    test_add_rms_norm_is_the_residual_add_then_the_norm,
    test_empty_batches_launch_nothing,
    test_rope_rotates_q_and_k_in_place_as_apply_rope,
    test_silu_mul_is_silu_of_gate_times_up,
)
