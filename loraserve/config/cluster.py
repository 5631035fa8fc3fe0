"""Scale-out over Ray Serve: the knobs of loraserve/cluster/."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.config.knobs import knob

ROUTING_POLICIES = ("affinity", "round_robin")  # cluster/routing.py


@dataclass(frozen=True)
class ClusterConfig:
    """Scale-out over Ray Serve (loraserve/cluster/). With replicas=1 and no ray_address,
    `serve` runs the single server and never imports ray."""

    replicas: int = knob(
        1, "engine replicas behind one ingress (Ray Serve, `pip install loraserve[cluster]`); "
           "above 1 a local Ray instance is started unless --ray-address is given")
    ray_address: str | None = knob(
        None, "join this Ray cluster (e.g. auto or HEAD_IP:6379) instead of starting one")
    routing: str = knob(
        "affinity", "affinity: an adapter's requests go to a replica that holds it (Ray Serve "
                    "multiplexing), else the least loaded; round_robin: in turn",
        ROUTING_POLICIES)
    replica_cpus: float = knob(
        1.0, "Ray CPUs each engine replica reserves (its torch threads unless --num-threads)")

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {list(ROUTING_POLICIES)}, "
                             f"got {self.routing!r}")
        if self.replica_cpus <= 0:
            raise ValueError("replica_cpus must be > 0")

    @property
    def enabled(self) -> bool:
        return self.replicas > 1 or self.ray_address is not None
