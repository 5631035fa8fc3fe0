"""Typed messages between the server side and the engine thread: commands in, snapshots out.

Plain data only (no callables), so the same messages could cross a process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.adapters.entry import AdapterSnapshot
from loraserve.adapters.format import LoraAdapterWeights
from loraserve.config import ModelConfig
from loraserve.model.structured import CompiledGrammar
from loraserve.types import SamplingParams

Prompt = str | list[int] | list[dict]


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    lora_name: str | None = None
    origin: str | None = None  # sequences of one client request share it (fair admission)
    fork_of: str | None = None  # n > 1: the sibling whose computed prompt this one shares
    client_id: str | None = None  # the client identity used for fairness (see Request)
    grammar: CompiledGrammar | None = None  # params.structured_outputs, compiled off-thread


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class PauseRequest:
    """Its client does not read its stream: take it out of the batch until resumed."""

    request_id: str


@dataclass(frozen=True)
class ResumeRequest:
    """Its client read: schedule it again."""

    request_id: str


@dataclass(frozen=True)
class CheckAdapterLoad:
    """Validate a load before any disk I/O. Reply: True when it is a no-op (already loaded
    from that path; at most it pins the adapter)."""

    name: str
    path: str
    pinned: bool = False
    replace: bool = False


@dataclass(frozen=True)
class LoadAdapter:
    """Commit an adapter; `weights` read and validated off the engine thread (None: the
    same name and path are registered already). `replace`: a new version of a loaded name;
    `version`: the number a deployment chose; `owned`: `path` is a spill copy the store
    removes with the version. Reply: the version now serving under `name`."""

    name: str
    path: str
    pinned: bool = False
    weights: LoraAdapterWeights | None = None
    replace: bool = False
    version: int | None = None
    owned: bool = False


@dataclass(frozen=True)
class UnloadAdapter:
    name: str


@dataclass(frozen=True)
class GetSnapshot:
    pass


@dataclass(frozen=True)
class CheckInvariants:
    """Run the engine's invariant check between steps. Reply: an InvariantReport."""


@dataclass(frozen=True)
class AbortAll:
    """End every request in flight with this error (the server is shutting down)."""

    message: str
    error_status: int = 503


EngineCommand = AddRequest | AbortRequest | PauseRequest | ResumeRequest | CheckAdapterLoad | \
    LoadAdapter | UnloadAdapter | GetSnapshot | AbortAll | CheckInvariants


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of the engine; fixed for the engine's lifetime."""

    model_name: str
    model_path: str
    model_config: ModelConfig
    max_model_len: int
    kv_capacity_tokens: int
    max_lora_rank: int
    allow_pickle_adapters: bool
    lora_backend: str


@dataclass(frozen=True)
class EngineSnapshot:
    """A consistent view of the engine between two steps (/metrics, /v1/models, debug)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_steps: int
    adapters: tuple[AdapterSnapshot, ...]
    model_name: str = ""
    base_prefix_queries: int = 0  # prompt tokens of base-model requests (see AdapterStats)
    base_prefix_hits: int = 0
    kv_blocks_cached: int = 0  # full blocks indexed by the prefix cache (held or free)
    paused: int = 0  # requests whose client does not read their stream
    base_in_flight: int = 0  # base-model requests running or waiting
    base_waiting: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total
