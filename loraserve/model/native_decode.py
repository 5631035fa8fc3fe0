"""A decode-only step's decoder layers in one C call (native_decode.c), for models whose every
projection runs on one of our kernels (float32 panels or quantized) without bias.

It runs the kernels the model's Python loop runs, in the same order, on the same buffers, so
a row's result is bit for bit the same whichever path its step took (the tests compare the
two); what it saves is the loop's per-layer dispatch, which at batch 1 costs about as much
as the layer's weight streaming. Steps it does not fit (a prefill or chunk among the rows,
a layer with a norm, window or cap it does not call) take the Python loop.

Adapters: a step with LoRA rows runs here where every projection is quantized and the LoRA
backend gives the C view of its op (`LoraHook.native`: the `cpu` backend, plain LoRA only);
each projection is then followed by the LoRA kernel, as the Python loop's backend does after a
quantized projection. Over float32 panels such steps take the Python loop, whose backend fuses
the LoRA op into the GEMM.

`build` returns None for a model it cannot run (a family with extra norms, a bias, experts,
bf16 or oneDNN weights, an activation other than SiLU, no C compiler); `LORASERVE_NATIVE_DECODE=0`
turns it off. A step of few rows over quantized panels runs in one OpenMP team
(native_decode.c says why); `LORASERVE_NATIVE_TEAM=0` gives each kernel its own instead.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from loraserve.model.attention.cpu import CpuAttention, CpuAttentionMetadata
from loraserve.model.attention.paged_decode import load as load_paged_decode
from loraserve.model.linear import Linear
from loraserve.model.quant_linear import QuantLinear
from loraserve.ops.cbuild import load_library_once
from loraserve.ops.elementwise import fused_enabled, fused_library
from loraserve.ops.gemm import gemm_library
from loraserve.ops.native_lora import NativeLoraStep
from loraserve.ops.qgemm import load_qgemm
from loraserve.ops.qpanel import PANEL_KINDS

SOURCE = Path(__file__).with_name("native_decode.c")
F32_PANELS = -1  # native_decode.c: KIND_F32_PANELS
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Projection(ctypes.Structure):
    _fields_ = [("fn", _ptr), ("team_fn", _ptr), ("kind", _i64), ("n", _i64), ("k", _i64),
                ("w", _ptr), ("w2", _ptr), ("w3", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection),
                ("down", _Projection), ("post_norm", _ptr), ("next_norm", _ptr),
                ("k_cache", _ptr), ("v_cache", _ptr), ("window", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [("rms_norm", _ptr), ("add_rms_norm", _ptr), ("silu_mul", _ptr), ("rope", _ptr),
                ("attention", _ptr), ("attention_team", _ptr), ("d", _i64), ("nh", _i64),
                ("kvh", _i64), ("hd", _i64), ("inter", _i64), ("block_size", _i64),
                ("eps", _f32), ("residual", _f32), ("scale", _f32), ("softcap", _f32),
                ("first_norm", _ptr), ("cos", _ptr), ("sin", _ptr)]


class _GreedyHead(ctypes.Structure):
    _fields_ = [("head", _Projection), ("final_norm", _ptr), ("embed", _ptr)]


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.native_decode.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Layer), _i64, _ptr,
                                  _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr,
                                  _i64, ctypes.c_int, _ptr, _ptr]
    lib.native_decode.restype = ctypes.c_int
    lib.native_decode_scratch_floats.argtypes = [ctypes.POINTER(_Model), _i64, ctypes.c_int]
    lib.native_decode_scratch_floats.restype = _i64
    lib.native_decode_in_team.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Layer), _i64,
                                          _i64, ctypes.c_int]
    lib.native_decode_in_team.restype = ctypes.c_int
    lib.native_decode_greedy.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Layer), _i64,
                                         ctypes.POINTER(_GreedyHead), _i64, _i64, _ptr, _ptr,
                                         _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr,
                                         _ptr, _i64, ctypes.c_int, _ptr, _ptr]
    lib.native_decode_greedy.restype = ctypes.c_int
    return lib


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _projection(linear) -> tuple[_Projection, object] | None:
    """The C description of a bias-free projection on one of our kernels (float32 panels, or
    quantized), with its work-bytes function (None: it needs no work); None for anything else
    (oneDNN's or MKL's float32 weights, bf16, a bias)."""
    if type(linear) is Linear:
        if linear.panels is None:
            return None
        lib = gemm_library()
        return (_Projection(_address(lib.gemm_packed), _address(lib.gemm_packed_team),
                            F32_PANELS, linear.out_features, linear.in_features,
                            linear.panels.data_ptr(), None, None), None)
    if type(linear) is not QuantLinear:
        return None
    if linear.panels_q is not None:
        p, lib = linear.panels_q, linear.panel_library
        return (_Projection(_address(lib.qpanel_gemm), _address(lib.qpanel_gemm_team),
                            PANEL_KINDS[p.kind], p.out_features,
                            p.in_features, p.w.data_ptr(), p.d.data_ptr(),
                            0 if p.m is None else p.m.data_ptr()), lib.qpanel_work_bytes)
    lib, q = load_qgemm(), linear.qweight
    if lib is None:
        return None
    return (_Projection(_address(lib.qgemm), None, q.kind, q.out_features, q.in_features,
                        q.qs.data_ptr(), q.d.data_ptr(), 0 if q.m is None else q.m.data_ptr()),
            lib.qgemm_work_bytes)


def _greedy_head(model, keep: list) -> tuple[_GreedyHead, object] | None:
    """The C description of what follows the last layer (final norm, lm_head, the next step's
    embedding rows), with lm_head's work-bytes function; None where the logits are more than
    that (a logits scale, a final soft cap) or lm_head is not on one of our kernels."""
    c, head = model.config, model.lm_head
    if (c.logits_scaling != 1.0 or c.final_softcap or not model.embed.is_contiguous()
            or model.embed.shape[0] < head.out_features or not model.final_norm.is_contiguous()):
        return None
    proj = _projection(head)
    if proj is None:
        return None
    keep += [model.embed, model.final_norm]
    return (_GreedyHead(proj[0], model.final_norm.data_ptr(), model.embed.data_ptr()),
            proj[1])


class NativeDecode:
    """The C layer loop of one model: its weights' addresses, taken once at load."""

    def __init__(self, lib: ctypes.CDLL, model_desc: _Model, layers: list[_Layer],
                 work_bytes: list, keep: list):
        self.lib, self.model_desc, self.work_bytes = lib, model_desc, work_bytes
        # steps with adapters only where no projection is float32 panels (module docstring)
        self.takes_lora = all(p.kind != F32_PANELS for layer in layers
                              for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self.layers = (_Layer * len(layers))(*layers)
        # the widest input of any projection: the GEMMs' work is sized for it
        self.k_max = max(model_desc.inter, model_desc.nh * model_desc.hd, model_desc.d)
        self._keep = keep  # the tensors whose addresses the descriptions hold
        self._caches: list | None = None
        self._attention_team = model_desc.attention_team
        # final norm, lm_head and embeddings for several greedy steps a call (None: not here)
        self.greedy_head: _GreedyHead | None = None

    def use_team(self, enabled: bool) -> None:
        """Whether steps that fit may run in one OpenMP team (native_decode.c says when); off,
        every kernel starts its own (the two compute the same bits: tests and A/Bs)."""
        self.model_desc.attention_team = self._attention_team if enabled else None

    def in_team(self, rows: int) -> bool:
        """Whether a step of `rows` decode rows runs in one team on torch's thread count."""
        return bool(self.lib.native_decode_in_team(self.model_desc, self.layers,
                                                   len(self.layers), rows,
                                                   torch.get_num_threads()))

    @classmethod
    def build(cls, model) -> NativeDecode | None:
        if os.environ.get("LORASERVE_NATIVE_DECODE", "1") == "0":
            return None
        c = model.config
        if c.hidden_act != "silu" or not model.embed.device.type == "cpu" \
                or model.embed.dtype != torch.float32 or len(model.ropes) != 1:
            return None
        layers, work_bytes, keep = [], {}, []
        for i, w in enumerate(model.layers):
            if (w.input_norm is None or w.post_norm is None or w.qk_norm is not None
                    or w.qk_full_norm is not None or w.attn_out_norm is not None
                    or w.mlp_out_norm is not None or w.moe is not None or w.rope != 0):
                return None
            projs = [_projection(p) for p in (w.qkv, w.o, w.gate_up, w.down)]
            if any(p is None for p in projs):
                return None
            work_bytes.update((id(fn), fn) for _, fn in projs if fn is not None)
            nxt = model.layers[i + 1].input_norm if i + 1 < len(model.layers) else None
            norms = [t.contiguous() for t in (w.post_norm, nxt) if t is not None]
            keep += norms
            layers.append(_Layer(*(p for p, _ in projs), norms[0].data_ptr(),
                                 norms[1].data_ptr() if nxt is not None else None, None, None,
                                 w.window))
        ew = fused_library()
        attn = load_paged_decode()
        if ew is None or attn is None:
            return None
        rope = model.ropes[0]
        first = model.layers[0].input_norm.contiguous()
        keep += [first, rope.cos, rope.sin]
        desc = _Model(_address(ew.rms_norm), _address(ew.add_rms_norm), _address(ew.silu_mul),
                      _address(ew.rope), _address(attn.paged_decode_attention),
                      _address(attn.paged_decode_attention_team), c.hidden_size,
                      c.num_attention_heads, c.num_key_value_heads, c.head_dim, model.inter,
                      0, c.rms_norm_eps, c.residual_multiplier, model.scale, c.attn_softcap or 0.0,
                      first.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr())
        lib = load_library_once(SOURCE, [], "the native decode loop", _configure)
        if lib is None:
            return None
        native = cls(lib, desc, layers, list(work_bytes.values()), keep)
        native.use_team(os.environ.get("LORASERVE_NATIVE_TEAM", "1") != "0")
        greedy = _greedy_head(model, keep)
        if greedy is not None:
            native.greedy_head, head_work = greedy
            if head_work is not None and head_work not in native.work_bytes:
                native.work_bytes.append(head_work)
        return native

    def fits(self, attention, meta, positions: torch.Tensor, max_positions: int) -> bool:
        """Whether this step's attention metadata is one the C loop runs: decodes only, on
        the CPU backend with its paged kernel, rows in order, positions within the tables."""
        return (self.fits_attention(attention) and isinstance(meta, CpuAttentionMetadata)
                and not meta.prefills and meta.decode_blocks is not None
                and meta.decode_contiguous and int(positions.max()) < max_positions)

    def fits_attention(self, attention) -> bool:
        """Whether the C loop can run this attention backend's decodes."""
        return (fused_enabled() and isinstance(attention, CpuAttention)
                and attention.kernel is not None)

    def run(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            attention: CpuAttention, meta: CpuAttentionMetadata,
            lora: NativeLoraStep | None = None) -> None:
        """Every layer over h ([B, d], the embeddings; the residual stream after the last
        layer on return), K/V written into `kv_caches`, the step's LoRA deltas added where
        `lora` is given (only where `takes_lora`)."""
        self._bind(kv_caches, attention)
        b, threads = h.shape[0], torch.get_num_threads()
        scratch, work, stride = self._buffers(b, threads)
        tables = meta.decode_blocks
        lora_t = None if lora is None else torch.empty(b * lora.ldt)
        rc = self.lib.native_decode(
            self.model_desc, self.layers, len(self.layers), h.data_ptr(), b,
            positions.data_ptr(), meta.slot_mapping.data_ptr(), meta.decode_rows.data_ptr(),
            tables.data_ptr(), tables.stride(0), meta.decode_lens.data_ptr(),
            scratch.data_ptr(), work.data_ptr(), stride, threads,
            None if lora is None else lora.desc.data_ptr(),
            None if lora_t is None else lora_t.data_ptr())
        if rc:
            raise RuntimeError(f"the native decode loop failed in layer {rc - 1}")

    def greedy(self, ids: list[int], computed: list[int], tables: list[list[int]], steps: int,
               kv_caches: list, attention: CpuAttention, max_positions: int,
               lora: NativeLoraStep | None = None) -> list[list[int]]:
        """`steps` decode steps of greedy rows in one call (only where `greedy_head`): row r
        feeds ids[r] at position computed[r], then each step the token its logits' first
        maximum picks; tables[r] holds its blocks for all `steps` positions. Returns each
        step's tokens, [steps][rows]: what as many steps of `run`, the final norm, lm_head
        and numpy's argmax give, bit for bit. `lora`: the adapters' op, as for `run`."""
        self._bind(kv_caches, attention)
        b, bs, d = len(ids), attention.block_size, self.model_desc.d
        pos = torch.tensor(computed).unsqueeze(0) + torch.arange(steps).unsqueeze(1)  # [K, B]
        if int(pos.max()) >= max_positions:
            raise ValueError(f"position {int(pos.max())} is past the rope table")
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        slots = (table.gather(1, (pos // bs).t()).t() * bs + pos % bs).contiguous()
        lens = pos + 1
        out = torch.empty(steps + 1, b, dtype=torch.int64)
        out[0] = torch.tensor(ids)
        h, normed = torch.empty(b, d), torch.empty(b, d)
        logits = torch.empty(b, self.greedy_head.head.n)
        rows, threads = torch.arange(b), torch.get_num_threads()
        scratch, work, stride = self._buffers(b, threads)
        lora_t = None if lora is None else torch.empty(b * lora.ldt)
        rc = self.lib.native_decode_greedy(
            self.model_desc, self.layers, len(self.layers), self.greedy_head, steps, b,
            out.data_ptr(), pos.data_ptr(), slots.data_ptr(), rows.data_ptr(),
            table.data_ptr(), table.stride(0), lens.data_ptr(), h.data_ptr(),
            normed.data_ptr(), logits.data_ptr(), scratch.data_ptr(), work.data_ptr(), stride,
            threads, None if lora is None else lora.desc.data_ptr(),
            None if lora_t is None else lora_t.data_ptr())
        if rc:
            where = "lm_head" if rc > len(self.layers) else f"layer {rc - 1}"
            raise RuntimeError(f"the native greedy decode loop failed in {where}")
        return out[1:].tolist()

    def _bind(self, kv_caches: list, attention: CpuAttention) -> None:
        """The K/V caches' addresses into the layers' descriptions, once per cache list."""
        if self._caches is not kv_caches:  # the runner's list: its tensors' addresses, once
            for layer, (k, v) in zip(self.layers, kv_caches, strict=True):
                layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
            self.model_desc.block_size = attention.block_size
            self._caches = kv_caches

    def _buffers(self, b: int, threads: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A step's scratch floats for b rows, the GEMMs' work bytes and the stride between
        the threads' shares of them (a thread of a team quantizes its own x)."""
        scratch = torch.empty(self.lib.native_decode_scratch_floats(self.model_desc, b,
                                                                    threads))
        stride = -(-max([64] + [fn(b, self.k_max) for fn in self.work_bytes]) // 64) * 64
        work = torch.empty(stride * max(threads, 1), dtype=torch.uint8)
        return scratch, work, stride
