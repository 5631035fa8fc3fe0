"""Build a C source of ours once into a shared library and load it with ctypes.

A library is one translation unit: a kernel's `.c` file and the headers it includes (shared
code lives in headers, static inline: ops/simd.h, ops/tuning.h, ops/gemm_tile.h, lora/*.h).
It is compiled once per source text (its headers' included), compiler, CPU (it is built with
`-march=native`) and flag set into `$LORASERVE_CACHE/kernels/`, written to a temp file and
renamed into place so concurrent processes never load a half-written file. It links the
libgomp that torch has already loaded, so our kernels and torch share one OpenMP thread pool.
Where no C compiler is found or the build fails, `load_library` returns None (with one
warning) and the caller falls back to its torch path.

`LORASERVE_CPU_ARCH` (default `native`) is the `-march` of every build: `x86-64-v3` builds for
AVX2, to imitate an AVX2-only host on an AVX-512 one (see docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from loraserve.paths import cache_root

log = logging.getLogger(__name__)
CFLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC",
          "-std=c11"]


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def arch_flags() -> list[str]:
    return [f"-march={os.environ.get('LORASERVE_CPU_ARCH', 'native')}"]


def _source_texts(source: Path, seen: set[Path] | None = None) -> list[str]:
    """The text of `source` and of the headers it includes with `#include "..."`, each once
    (e.g. lora/gemm_expand_cpu.c includes ops/gemm_tile.h, which includes ops/simd.h), so an
    edit to any of them rebuilds it."""
    seen = set() if seen is None else seen
    seen.add(source)
    text = source.read_text()
    out = [text]
    for m in re.finditer(r'^\s*#\s*include "([^"]+)"', text, re.MULTILINE):
        dep = (source.parent / m.group(1)).resolve()
        if dep not in seen:
            out += _source_texts(dep, seen)
    return out


def compile_once(cc: str, source: Path, flags: list[str]) -> Path:
    """The shared library of `source` built with `flags`, compiling it only if not cached."""
    flags = arch_flags() + flags
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([*_source_texts(source), cc, version, _cpu_id(), *CFLAGS,
                                    *flags]).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, *flags, str(source), "-o", tmp], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_once_lock = threading.Lock()
_once: dict[tuple[Path, tuple[str, ...]], ctypes.CDLL | None] = {}


def load_library_once(source: Path, flags: list[str], what: str,
                      configure: Callable[[ctypes.CDLL], ctypes.CDLL | None]
                      ) -> ctypes.CDLL | None:
    """`load_library` once per process and (source, flags): the first call builds, loads and
    `configure`s it (sets argtypes; may return None to refuse it), later ones get that result."""
    key = (source, tuple(flags))
    with _once_lock:
        if key not in _once:
            lib = load_library(source, flags, what)
            _once[key] = None if lib is None else configure(lib)
        return _once[key]


def load_library(source: Path, flags: list[str], what: str) -> ctypes.CDLL | None:
    """`source` compiled (once) and loaded; None, with a warning naming `what`, if it cannot
    be. ctypes releases the GIL for the length of every call into it."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    try:
        if cc is None:
            raise RuntimeError("no C compiler (gcc/cc) on PATH")
        return ctypes.CDLL(str(compile_once(cc, source, flags)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("%s unavailable, using the torch path: %s", what, detail)
        return None
