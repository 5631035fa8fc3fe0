"""Keep the heap built at start-up out of the cyclic garbage collector's full passes.

A serving process holds a few million long-lived objects from start-up (the model's modules,
torch, transformers, the tokenizer, FastAPI's routes). Python's full (generation-2) collection
walks all of them, on whichever thread allocates, holding the GIL: the engine's step and
every response wait for it (docs/tenancy.md has what it cost).
`gc.freeze()` after a collection moves what is alive now to a permanent generation the
collector never walks; garbage made while serving is collected as before. vLLM and SGLang
freeze their start-up heap for the same reason. Called once per serving process, after the
engine is built (not inside create_app: a test process builds many apps, and what a freeze
holds is never collected)."""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze what survives; returns how many objects were frozen. At exit they
    are unfrozen, so the interpreter's last collection frees them as it would have (frozen,
    extension objects in cycles outlived it, and nanobind reported them leaked)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()
