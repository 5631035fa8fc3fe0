"""The cluster's adapter registry: which adapters every replica must have, and from where.

A tiny deployment (one replica, no CPU). The ingress is its only writer and commits an entry
only after every replica accepted the load; replicas read it to replay the registry when they
start and to catch up whenever a request carries a newer version than they have applied
(a replica that joined while a load was being broadcast). `epoch` changes when the registry
itself restarts, so nobody mistakes a fresh registry's version 0 for an old one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RegistryEntry:
    lora_path: str  # as the client sent it; each replica resolves it (--lora-root)
    pinned: bool = False
    version: int = 1  # the name's version (name@N), the same number on every replica


@dataclass(frozen=True)
class RegistryVersion:
    epoch: str
    version: int

    def covers(self, want: RegistryVersion | None) -> bool:
        """True when this state is at least as new as `want` (None: anything goes)."""
        return want is None or (self.epoch == want.epoch and self.version >= want.version)


@dataclass(frozen=True)
class RegistryState:
    at: RegistryVersion
    entries: dict[str, RegistryEntry] = field(default_factory=dict)


EMPTY = RegistryState(RegistryVersion("", -1))


class AdapterRegistry:
    """Deployment class: holds the state; every change bumps the version."""

    def __init__(self, seed: tuple[tuple[str, str], ...] = ()):
        self._at = RegistryVersion(uuid.uuid4().hex[:12], 0)
        self._entries = {name: RegistryEntry(path) for name, path in seed}
        self._last_version = {name: 1 for name, _ in seed}

    def reserve_version(self, name: str) -> int:
        """The number for the next load of `name`. Never handed out twice, even if that load
        is refused and rolled back: a replica that had accepted it keeps it as used."""
        self._last_version[name] = self._last_version.get(name, 0) + 1
        return self._last_version[name]

    def state(self) -> RegistryState:
        return RegistryState(self._at, dict(self._entries))

    def put(self, name: str, entry: RegistryEntry) -> RegistryVersion:
        self._entries[name] = entry
        return self._bump()

    def remove(self, name: str) -> RegistryVersion:
        self._entries.pop(name, None)
        return self._bump()

    def _bump(self) -> RegistryVersion:
        self._at = RegistryVersion(self._at.epoch, self._at.version + 1)
        return self._at
