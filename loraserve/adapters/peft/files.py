"""Opening an adapter's files with care, before anything is parsed: every file must resolve
inside the allowed root (symlinks followed, per file, not only the folder; hard links refused,
since a hard link's other names can lie anywhere on the file system), each file is read from
one open descriptor (what was checked is what is read), and a safetensors file's size and
header are checked before a byte of its tensors is read."""

from __future__ import annotations

import os
from pathlib import Path

from loraserve.adapters.peft.safetensors_header import TensorEntry, read_header
from loraserve.config import LORA_MODULES, ModelConfig
from loraserve.types import AdapterFilesChangedError, AdapterFormatError


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def check_inside(file: Path, root: str | None, path: object) -> None:
    """`file` (after every symlink) lies inside `root` and is no hard link; no root: anything
    goes."""
    if root is None:
        return
    real_root, real = os.path.realpath(root), os.path.realpath(file)
    if os.path.commonpath([real, real_root]) != real_root:
        raise _fail(path, f"{file.name} resolves outside the allowed directory (--lora-root; "
                          "symlinks are followed)")
    if os.stat(real).st_nlink > 1:
        raise _fail(path, f"{file.name} is a hard link (it has {os.stat(real).st_nlink} names); "
                          "under --lora-root a file's other names may lie outside it, so "
                          "adapter files must be plain files with one name")


def read_limited(file: Path, max_bytes: int, path: object, what: str) -> bytes:
    """The whole file, refused without reading it when it is larger than `max_bytes`."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise _fail(path, f"{file.name} is {size} bytes; {what} is at most {max_bytes}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise AdapterFilesChangedError(f"adapter {path}: {file.name} grew past {max_bytes} "
                                       "bytes while it was read")
    return data


def max_weights_bytes(model_config: ModelConfig, max_lora_rank: int) -> int:
    """The largest weights file an acceptable adapter can need: every module (and expert) of
    every layer at max_lora_rank in float64, with its bias and magnitude vectors, LoRA on the
    embedding and lm_head, and four [V, d] tables (each end's copy and the base weight PEFT
    saves next to a targeted embedding), plus room for the header."""
    mc = model_config
    per_rank = sum(sum(mc.module_shape(m)) for m in LORA_MODULES)
    vectors = 2 * sum(mc.module_shape(m)[0] for m in LORA_MODULES)
    # each expert's gate, up and down: A and B at max_lora_rank (per module, v4's form, is
    # the larger of the two forms peft/expert_targets.py reads)
    per_rank += mc.num_experts * 3 * (mc.moe_intermediate_size + mc.hidden_size)
    vocab = mc.vocab_size + mc.hidden_size
    return ((per_rank * max_lora_rank + vectors) * mc.num_hidden_layers
            + 2 * vocab * max_lora_rank + 4 * mc.vocab_size * mc.hidden_size) * 8 + (1 << 20)


# embed_tokens and lm_head: LoRA A/B, a full copy, trainable tokens, the saved base weight
VOCAB_END_TENSORS = 16


def max_tensors(model_config: ModelConfig) -> int:
    """A bound on the header's entries, before any is looked at: an A and a B per LoRA module
    of every layer, four times over (room for lora_bias and DoRA's magnitude), plus the
    vocabulary ends' parts (stray tensors are then refused by name); an A and a B per expert
    weight, or per expert module (peft/expert_targets.py)."""
    experts = model_config.num_experts
    per_layer = 4 * 2 * len(LORA_MODULES) + (2 * 2 + 2 * 3 * experts if experts else 0)
    return per_layer * model_config.num_hidden_layers + VOCAB_END_TENSORS


def open_safetensors(file: Path, path: object, max_bytes: int,
                     model_config: ModelConfig) -> tuple[list[TensorEntry], bytes]:
    """The validated header entries and the file's bytes. An oversized file, or one whose
    header does not describe exactly its bytes, is refused before its tensors are read."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise _fail(path, f"{file.name} is {size} bytes, more than an adapter of this "
                              f"model within max_lora_rank can hold ({max_bytes})")
        entries = read_header(f, size, file.name, path, max_tensors(model_config))
        f.seek(0)
        data = f.read(size + 1)
    if len(data) != size:
        raise AdapterFilesChangedError(f"adapter {path}: {file.name} changed size while it "
                                       "was read")
    return entries, data
