"""Which replica serves a request: Ray Serve request routers for the engine deployment.

Both routers run inside the ingress process (a deployment handle's router) and share two
rules: a control call naming a replica (`target=` keyword: load/unload, /v1/models, /metrics
fan-out) goes to that replica only; a request with no adapter (the base model) goes to the
least loaded replica (Ray probes queue lengths and takes the lowest of a rank).

- AdapterAffinityRouter: the multiplexed model id is the adapter's name. Replicas that hold it
  (the ids each replica's `@serve.multiplexed` cache reports, plus where this router sent it in
  the last few seconds, since reports lag) form the first rank, unless they are much busier
  than the least loaded replica; everyone else is the next rank.
- RoundRobinRouter: in turn, whatever the adapter (the baseline the benchmark compares with).

Each router registers itself by deployment (live_replicas.py) so the ingress can list the
live replicas, the set it broadcasts adapter loads to. Ray pickles this module by value into
the routing process: keep module-level state out of it.
"""

from __future__ import annotations

import itertools
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

TARGET_KWARG = "target"
STICKY_S = 5.0  # a routing decision stands in for the replica's report this long


def target_of(pending: PendingRequest | None) -> str | None:
    return pending.kwargs.get(TARGET_KWARG) if pending is not None else None


def adapter_of(pending: PendingRequest | None) -> str:
    return pending.metadata.multiplexed_model_id if pending is not None else ""


class _LoraserveRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        from loraserve.cluster import live_replicas  # the real module, not a pickled copy

        dep = self._deployment_id
        live_replicas.register(dep.app_name, dep.name, self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # without it Ray retries at once, spinning, when every candidate is full
            pending_request.routing_context.should_backoff = True
        target = target_of(pending_request)
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        return self.rank(candidate_replicas, adapter_of(pending_request))

    def rank(self, replicas: list[RunningReplica], adapter: str) -> list[list[RunningReplica]]:
        raise NotImplementedError


class AdapterAffinityRouter(_LoraserveRouter):
    def initialize_state(self, imbalance_threshold: int = 4, **kwargs) -> None:
        super().initialize_state(**kwargs)
        # a holder this many requests busier than the least loaded replica loses its claim:
        # a popular adapter must not pile every request onto one replica
        self.imbalance_threshold = imbalance_threshold
        self._sent: dict[str, tuple[str, float]] = {}  # adapter -> (replica, when)

    def holders(self, replicas: list[RunningReplica], adapter: str) -> list[RunningReplica]:
        sent = self._sent.get(adapter)
        recent = sent[0] if sent and time.monotonic() - sent[1] < STICKY_S else None
        return [r for r in replicas if adapter in r.multiplexed_model_ids
                or r.replica_id.unique_id == recent]

    def rank(self, replicas: list[RunningReplica], adapter: str) -> list[list[RunningReplica]]:
        if not adapter:
            return [replicas]
        holders = self.holders(replicas, adapter)
        if not holders:
            return [replicas]
        if self._imbalanced(holders, replicas):
            return [replicas]
        return [holders, [r for r in replicas if r not in holders]]

    def _imbalanced(self, holders, replicas) -> bool:
        cache = self.replica_queue_len_cache
        lens = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        if any(v is None for v in lens.values()):
            return False  # unknown: Ray probes the first rank anyway
        best_holder = min(lens[r.replica_id] for r in holders)
        return best_holder - min(lens.values()) >= self.imbalance_threshold

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        adapter = adapter_of(pending_request)
        if adapter and target_of(pending_request) is None:
            self._sent[adapter] = (replica_id.unique_id, time.monotonic())


class RoundRobinRouter(_LoraserveRouter):
    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._turn = itertools.count()

    def rank(self, replicas: list[RunningReplica], adapter: str) -> list[list[RunningReplica]]:
        if not replicas:
            return []
        ordered = sorted(replicas, key=lambda r: r.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        # the next in turn first; the others only if it refuses (its queue is full)
        return [[ordered[start]], ordered[start + 1:] + ordered[:start]]


# by import path: Ray loads the class in the ingress process rather than unpickling a copy
ROUTERS = {"affinity": f"{__name__}.AdapterAffinityRouter",
           "round_robin": f"{__name__}.RoundRobinRouter"}


def routing_key(model: object, base_names: frozenset[str]) -> str:
    """The adapter a request's `model` names ('' for the base model or anything unusable:
    the replica's app gives such requests their proper answer)."""
    if not isinstance(model, str) or not model or model in base_names:
        return ""
    base, sep, adapter = model.partition(":")
    if sep:
        return adapter if base in base_names else ""
    return model
