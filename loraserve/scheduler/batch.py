"""Value objects the scheduler hands to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from loraserve.request import Request


@dataclass
class ScheduledBatch:
    entries: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # could never run: why

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    @property
    def adapter_uids(self) -> set[int]:
        return {r.adapter_uid for r, _ in self.entries if r.adapter_uid is not None}

    def __bool__(self) -> bool:
        return bool(self.entries)


class AdapterState(Enum):
    READY = "ready"  # weights in host memory and a slot can be had for it
    LOADING = "loading"  # not in host memory yet; a load is under way
    NO_SLOT = "no_slot"  # every slot is held by running or pinned adapters
    FAILED = "failed"  # its load failed: the waiting request must get an error


class AdapterGate(Protocol):
    """What the scheduler asks of the adapter store (implemented by adapters.store)."""

    def admission(self, uid: int, running_uids: set[int]) -> tuple[AdapterState, str]:
        """May a request for `uid` join a batch whose running adapters are `running_uids`?
        Never blocks; may start a background load."""
        ...


class BaseOnlyGate:
    """The gate of an engine without adapters."""

    def admission(self, uid: int, running_uids: set[int]) -> tuple[AdapterState, str]:
        return AdapterState.FAILED, f"adapter uid {uid} is unknown"
