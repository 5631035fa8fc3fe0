"""Opening an adapter's files with care, before anything is parsed: every file must resolve
inside the allowed root (symlinks followed, per file, not only the folder), and a safetensors
file's size and header are checked before a byte of its tensors is read."""

from __future__ import annotations

import json
import os
from pathlib import Path

from loraserve.config import LORA_MODULES, ModelConfig
from loraserve.types import AdapterFormatError

MAX_HEADER_BYTES = 16 << 20  # a LoRA header lists a few thousand tensors: far below this


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def check_inside(file: Path, root: str | None, path: object) -> None:
    """`file` (after every symlink) lies inside `root`; no root: anything goes."""
    if root is None:
        return
    real_root, real = os.path.realpath(root), os.path.realpath(file)
    if os.path.commonpath([real, real_root]) != real_root:
        raise _fail(path, f"{file.name} resolves outside the allowed directory (--lora-root; "
                          "symlinks are followed)")


def max_weights_bytes(model_config: ModelConfig, max_lora_rank: int) -> int:
    """The largest weights file an acceptable adapter can need: every module of every layer
    at max_lora_rank in float64, with its bias and magnitude vectors, LoRA on the embedding
    and lm_head, and four [V, d] tables (each end's copy and the base weight PEFT saves next
    to a targeted embedding), plus room for the header."""
    mc = model_config
    per_rank = sum(sum(mc.module_shape(m)) for m in LORA_MODULES)
    vectors = 2 * sum(mc.module_shape(m)[0] for m in LORA_MODULES)
    vocab = mc.vocab_size + mc.hidden_size
    return ((per_rank * max_lora_rank + vectors) * mc.num_hidden_layers
            + 2 * vocab * max_lora_rank + 4 * mc.vocab_size * mc.hidden_size) * 8 + (1 << 20)


def check_safetensors(file: Path, path: object, max_bytes: int) -> None:
    """Refuse an oversized file, or one whose header does not describe exactly its bytes,
    without reading its tensors."""
    size = file.stat().st_size
    if size > max_bytes:
        raise _fail(path, f"{file.name} is {size} bytes, more than an adapter of this model "
                          f"within max_lora_rank can hold ({max_bytes})")
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise _fail(path, f"corrupt or truncated {file.name}: bad header length")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise _fail(path, f"corrupt {file.name}: its header is not JSON") from None
    if not isinstance(header, dict):
        raise _fail(path, f"corrupt {file.name}: its header is not a JSON object")
    ends = [v.get("data_offsets", [0, 0])[1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict)]
    if 8 + n + max(ends, default=0) != size:
        raise _fail(path, f"corrupt or truncated {file.name}: its header describes "
                          f"{8 + n + max(ends, default=0)} bytes, the file has {size}")
