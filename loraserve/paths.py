"""The one cache directory: the converted bundled model, built kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$LORASERVE_CACHE`, or `~/.cache/loraserve`."""
    env = os.environ.get("LORASERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loraserve"


def describe_os_error(e: OSError) -> str:
    """An OSError in one line; one inside the cache directory says so and how to fix it
    (an unreadable, unwritable or full cache fails at start, not with a traceback)."""
    root = str(cache_root())
    where = str(e.filename or "")
    text = f"{e.strerror or e}: {where}" if where else str(e.strerror or e)
    if where.startswith(root):
        return (f"the cache directory {root} is not usable ({text}); free some space or "
                "point LORASERVE_CACHE at a writable directory")
    return text
