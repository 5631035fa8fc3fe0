"""The one cache directory: the converted bundled model, built kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$LORASERVE_CACHE`, or `~/.cache/loraserve`."""
    env = os.environ.get("LORASERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loraserve"
