"""What a cluster deployment is built from: plain frozen values that Ray ships to every actor."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.config import ClusterConfig, EngineConfig
from loraserve.server.settings import ServerSettings

APP_NAME = "loraserve"
ENGINE_DEPLOYMENT = "LoraserveEngine"
REGISTRY_DEPLOYMENT = "LoraserveAdapterRegistry"
INGRESS_DEPLOYMENT = "LoraserveIngress"


@dataclass(frozen=True)
class ClusterSpec:
    model: str | None = None  # None: the bundled default model
    engine: EngineConfig = field(default_factory=EngineConfig)
    settings: ServerSettings = field(default_factory=ServerSettings)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # --lora-paths: the registry's first entries, replayed by every replica at start
    adapters: tuple[tuple[str, str], ...] = ()
    # how long the ingress waits for one replica's answer to a control call (load, models)
    control_timeout_s: float = 120.0
    # --shutdown-timeout: on a signal, how long requests in flight may take to finish
    shutdown_timeout_s: float = 10.0
