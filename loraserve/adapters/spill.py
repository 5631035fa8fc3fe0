"""Adapters that arrive without a directory of their own (a trainer's tensors, an upload).

They are written once, as a PEFT directory, into the engine's spill directory and then
loaded like any other adapter: the same validation and limits, and a copy on disk the store
can reload from after an eviction (an adapter whose only copy is in compute memory could never
be evicted). The store owns such a directory and removes it when the version is freed.

Layout: `<cache>/adapter-copies/<pid>-<random>/<name>-<random>/`; a process's folder is
removed at shutdown, and the folders of processes that are gone are swept at start-up.
"""

from __future__ import annotations

import atexit
import enum
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from loraserve.adapters.format import CONFIG_FILE, SAFETENSORS_FILE
from loraserve.paths import cache_root
from loraserve.types import AdapterFormatError

_ROOT_NAME = "adapter-copies"
_lock = threading.Lock()
_process_spill: SpillDir | None = None


def spill_dir() -> SpillDir:
    """The process's one spill directory: the server writes uploads into it and the store
    (which removes copies) must recognise them, on whichever thread."""
    global _process_spill
    with _lock:
        if _process_spill is None:
            _process_spill = SpillDir()
            atexit.register(_process_spill.close)
        return _process_spill


class SpillDir:
    """This process's folder of adapter copies (made on first use)."""

    def __init__(self, base: Path | None = None):
        self.base = (base or cache_root()) / _ROOT_NAME
        self._dir: Path | None = None
        self._lock = threading.Lock()

    def _own_dir(self) -> Path:
        with self._lock:
            return self._make_own_dir()

    def _make_own_dir(self) -> Path:
        if self._dir is None:
            self.base.mkdir(parents=True, exist_ok=True)
            _sweep_dead(self.base)
            self._dir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self.base))
        return self._dir

    def new_adapter_dir(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._own_dir()))

    def owns(self, path: str | os.PathLike) -> bool:
        return self._dir is not None and Path(path).resolve().parent == self._dir.resolve()

    def remove(self, path: str | os.PathLike) -> None:
        """Delete one adapter copy; anything outside this process's folder is left alone."""
        if self.owns(path):
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def write(self, name: str, tensors: Mapping[str, torch.Tensor], config) -> Path:
        """A PEFT directory holding `tensors` (PEFT's state-dict names, as
        `peft.get_peft_model_state_dict` gives them) and `config` (a dict or a PEFT
        `LoraConfig`). Validation is the reader's job; this checks only what it must write."""
        cfg = _config_dict(config)
        if not isinstance(tensors, Mapping) or not tensors:
            raise AdapterFormatError("tensors: expected a non-empty dict of name -> Tensor")
        bad = [k for k, v in tensors.items()
               if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise AdapterFormatError(f"tensors: not a name -> Tensor entry: {bad[0]!r}")
        out = self.new_adapter_dir(name)
        try:
            from safetensors.torch import save_file

            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                      str(out / SAFETENSORS_FILE))
            (out / CONFIG_FILE).write_text(json.dumps(cfg))
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        return out


def _config_dict(config) -> dict:
    if hasattr(config, "to_dict"):  # a PEFT config object
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise AdapterFormatError("config: expected adapter_config.json's contents as a dict "
                                 "(or a PEFT LoraConfig)")
    try:
        return json.loads(json.dumps(config, default=_jsonable))
    except (TypeError, ValueError) as e:
        raise AdapterFormatError(f"config: not JSON-serializable ({e})") from None


def _jsonable(value):
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _sweep_dead(base: Path) -> None:
    """Remove the folders of processes that no longer run (a crash leaves them behind)."""
    for d in base.iterdir():
        pid = d.name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
