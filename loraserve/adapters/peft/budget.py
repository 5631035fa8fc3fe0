"""How much work reading one adapter may take, so a hostile file costs bounded time.

An adapter's files come from whoever may load adapters; the server's other clients must not
notice. Every bound is checked before the work it bounds (the config's bytes before parsing,
its depth and pattern count before matching), and the work that remains is checked against a
deadline item by item. A load over a bound is refused (400) naming the bound; a load cancelled
because the server is shutting down ends at its next check.
"""

from __future__ import annotations

import threading
import time

from loraserve.types import AdapterFormatError, AdapterLoadCancelledError

MAX_CONFIG_BYTES = 1 << 20  # a rank_pattern for every module of a 100-layer model: ~60 KB
MAX_CONFIG_DEPTH = 8  # PEFT's configs nest 3 levels (layer_replication: a list of pairs)
MAX_PATTERNS = 4096  # target/exclude modules + rank_pattern + alpha_pattern entries
MAX_LOAD_SECONDS = 10.0  # config, patterns and targets; the weights are bounded by size


class LoadBudget:
    def __init__(self, seconds: float = MAX_LOAD_SECONDS,
                 cancelled: threading.Event | None = None):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.cancelled = cancelled

    def check(self, path: object, doing: str) -> None:
        """Raise if the load was cancelled or ran past its deadline."""
        if self.cancelled is not None and self.cancelled.is_set():
            raise AdapterLoadCancelledError(
                f"adapter {path}: the load was cancelled (the server is shutting down)")
        if time.monotonic() > self.deadline:
            raise AdapterFormatError(
                f"adapter {path}: reading it exceeded the per-load time budget of "
                f"{self.seconds:g} s while {doing}")


def check_config_shape(cfg: object, path: object) -> None:
    """The parsed config nests at most MAX_CONFIG_DEPTH levels (iteratively: no recursion)."""
    stack = [(cfg, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise AdapterFormatError(f"adapter {path}: adapter_config.json nests deeper than "
                                     f"{MAX_CONFIG_DEPTH} levels (the per-load depth bound)")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def count_patterns(cfg: dict) -> int:
    """Entries that are matched against module names, as PEFT would."""
    n = 0
    for key in ("target_modules", "exclude_modules", "layers_pattern", "target_parameters"):
        v = cfg.get(key)
        n += len(v) if isinstance(v, list) else int(v is not None)
    for key in ("rank_pattern", "alpha_pattern"):
        v = cfg.get(key)
        n += len(v) if isinstance(v, dict) else 0
    return n


def check_pattern_count(cfg: dict, path: object) -> None:
    if (n := count_patterns(cfg)) > MAX_PATTERNS:
        raise AdapterFormatError(
            f"adapter {path}: adapter_config.json has {n} module patterns (target_modules, "
            f"target_parameters, exclude_modules, rank_pattern, alpha_pattern); the per-load "
            f"bound is {MAX_PATTERNS}")
