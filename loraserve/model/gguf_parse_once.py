"""Parse a GGUF file's header once per conversion, not once per reader transformers makes.

transformers (5.23) reads a GGUF file three times while converting it (for the config, the
tokenizer and the weights), each time parsing the whole header, every vocabulary entry one
element at a time, and it builds gguf's tensor-name table anew for every tensor. With a
49k-token vocabulary those repeats are most of a conversion's time. Inside `parse_once()`
each file is parsed once and each name table built once: callers only read both, so the
converted checkpoint is the same, byte for byte (tests/engine/test_model_gguf.py).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()  # one conversion at a time patches the module


@contextmanager
def parse_once() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` hands back one reader per path and
    `gguf.get_tensor_name_map` one table per (architecture, blocks)."""
    import gguf

    with _lock:
        make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], gguf.GGUFReader] = {}

        def reader(path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = make_reader(path, mode)
            return readers[key]

        gguf.GGUFReader = reader
        gguf.get_tensor_name_map = functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map
