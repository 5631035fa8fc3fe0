"""A safetensors header, validated field by field before a byte of tensor data is read.

The format (safetensors' own spec): 8 bytes of little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then
the data. Offsets are relative to the data; the tensors tile it exactly, in order, with no gap
or overlap, and each spans shape's product times its dtype's size. Every field that breaks a
rule is refused with a message naming the tensor and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import BinaryIO

from loraserve.types import AdapterFormatError

MAX_HEADER_BYTES = 16 << 20  # a LoRA header lists a few thousand tensors: far below this
MAX_DIMS = 8
# the floating-point dtypes LoRA weights come in; integer ones are refused by name
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(f: BinaryIO, size: int, file_name: str, path: object,
                max_tensors: int) -> list[TensorEntry]:
    """The validated entries of the safetensors file open as `f` (at offset 0, `size` bytes)."""

    def fail(problem: str) -> AdapterFormatError:
        return AdapterFormatError(f"adapter {path}: {file_name}: {problem}")

    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
        raise fail("corrupt or truncated: bad header length")
    raw = f.read(n)
    if len(raw) != n:
        raise fail("truncated header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise fail("corrupt: its header is not JSON") from None
    if not isinstance(header, dict):
        raise fail("corrupt: its header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise fail("__metadata__ must be an object of strings")
    if len(header) > max_tensors:
        raise fail(f"{len(header)} tensors; an adapter of this model has at most {max_tensors}")
    data_len = size - 8 - n
    spans, entries = [], []
    for name, info in header.items():
        entry, span = _entry(name, info, data_len, fail)
        entries.append(entry)
        spans.append((*span, name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise fail(f"tensor {name!r}: data_offsets leave a gap or overlap another tensor "
                       f"(begins at {begin}, the previous one ends at {end})")
        end = stop
    if end != data_len:
        raise fail(f"corrupt or truncated: its header describes {8 + n + end} bytes, the file "
                   f"has {size}")
    return entries


def _entry(name: str, info: object, data_len: int, fail) -> tuple[TensorEntry, tuple[int, int]]:
    if not isinstance(info, dict):
        raise fail(f"tensor {name!r}: its entry must be an object")
    extra = set(info) - {"dtype", "shape", "data_offsets"}
    if extra:
        raise fail(f"tensor {name!r}: unknown fields {sorted(extra)}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise fail(f"tensor {name!r}: dtype {_short(dtype)} is not a floating-point dtype "
                   f"({', '.join(DTYPE_BYTES)})")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(_is_int(d) and d >= 0 for d in shape)):
        raise fail(f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} non-negative "
                   f"integers, got {_short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise fail(f"tensor {name!r}: data_offsets must be a list of two integers, got "
                   f"{_short(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise fail(f"corrupt or truncated: tensor {name!r}: data_offsets {offsets} lie "
                   f"outside the data (0..{data_len})")
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != want:
        raise fail(f"tensor {name!r}: data_offsets span {end - begin} bytes; shape {shape} of "
                   f"{dtype} needs {want}")
    return TensorEntry(name, dtype, tuple(shape)), (begin, end)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
