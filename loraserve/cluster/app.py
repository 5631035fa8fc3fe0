"""The Ray Serve application: an ingress, N engine replicas and the adapter registry.

`loraserve serve --replicas N` builds it from its flags (launch.py). With Ray Serve's own
command it is built from `key=value` args named like `loraserve serve`'s flags:

    serve run loraserve.cluster.app:build_app replicas=2 max-loaded-loras=8 \\
        lora-paths="sql=/ads/sql chat=/ads/chat" allow-runtime-lora-updates=true

or from a config file (docs/cluster.yaml): `serve deploy docs/cluster.yaml`.
"""

from __future__ import annotations

import dataclasses
import types
import typing

from ray import serve
from ray.serve.config import RequestRouterConfig

from loraserve.cluster.ingress import Ingress
from loraserve.cluster.registry import AdapterRegistry
from loraserve.cluster.replica import EngineReplica
from loraserve.cluster.routing import ROUTERS
from loraserve.cluster.spec import (
    ENGINE_DEPLOYMENT,
    INGRESS_DEPLOYMENT,
    REGISTRY_DEPLOYMENT,
    ClusterSpec,
)
from loraserve.config import ClusterConfig, EngineConfig
from loraserve.server.settings import ServerSettings

# requests one replica takes at once; beyond it Ray holds them at the ingress (fair routing)
MAX_ONGOING_PER_REPLICA = 64
# how often a stopping replica looks whether its requests in flight are done: Ray's default
# (2 s) is waited out before even an idle replica stops, and stopping the app waits for it
DRAIN_POLL_S = 0.25
# the ingress stays this much longer than the engine replicas' drain, to relay their last bytes
RELAY_GRACE_S = 5.0


def build_from_spec(spec: ClusterSpec):
    """The bound application graph (serve.run takes it)."""
    cl = spec.cluster
    drain = {"graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
             "graceful_shutdown_timeout_s": spec.shutdown_timeout_s}
    registry = serve.deployment(AdapterRegistry, name=REGISTRY_DEPLOYMENT, num_replicas=1,
                                ray_actor_options={"num_cpus": 0}, **drain).bind(spec.adapters)
    engines = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=cl.replicas,
        max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
        ray_actor_options={"num_cpus": cl.replica_cpus},
        # the model loads in the constructor; a tiny one in seconds, a large one in minutes
        health_check_timeout_s=60,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[cl.routing]),
        **drain,
    ).bind(spec, registry)
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT, num_replicas=1,
                               max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0},
                               **{**drain, "graceful_shutdown_timeout_s":
                                  spec.shutdown_timeout_s + RELAY_GRACE_S})
    return ingress.bind(engines, registry, spec)


def build_app(args: dict[str, typing.Any]):
    """`serve run loraserve.cluster.app:build_app key=value ...`: the args are `loraserve
    serve`'s flags without the dashes (booleans as true/false, lora-paths as NAME=PATH words)."""
    return build_from_spec(spec_from_args(args))


def spec_from_args(args: dict[str, typing.Any]) -> ClusterSpec:
    values = {k.replace("-", "_"): v for k, v in (args or {}).items()}
    adapters = values.pop("lora_paths", None) or ()
    if isinstance(adapters, str):
        adapters = adapters.split()
    if isinstance(adapters, dict):
        adapters = [f"{k}={v}" for k, v in adapters.items()]
    pairs = []
    for item in adapters:
        name, sep, path = str(item).partition("=")
        if not sep:
            raise ValueError(f"lora-paths expects NAME=PATH words, got {item!r}")
        pairs.append((name, path))
    model = values.pop("model", None)
    shutdown_timeout = values.pop("shutdown_timeout", None)
    served = values.pop("served_model_name", None)
    names = tuple(served.split() if isinstance(served, str) else served or ())
    configs = {cls: _take(cls, values) for cls in (EngineConfig, ClusterConfig, ServerSettings)}
    if values:
        raise ValueError(f"unknown cluster app args: {sorted(values)}")
    settings = configs[ServerSettings]
    settings["served_model_names"] = names + ((model,) if model else ())
    spec = ClusterSpec(model=model, engine=EngineConfig(**configs[EngineConfig]),
                       settings=ServerSettings(**settings),
                       cluster=ClusterConfig(**configs[ClusterConfig]), adapters=tuple(pairs))
    if shutdown_timeout is not None:
        spec = dataclasses.replace(spec, shutdown_timeout_s=float(shutdown_timeout))
    return spec


def _take(cls, values: dict) -> dict:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            out[f.name] = _coerce(values.pop(f.name), hints[f.name])
    return out


def _coerce(value, hint):
    """A `key=value` string (or a YAML value) as the field's type."""
    if not isinstance(value, str):
        return value
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if type(None) in kinds and value.lower() in ("", "none", "null"):
        return None
    kind = next(k for k in kinds if k is not type(None))
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    if kind in (int, float):
        return kind(value)
    return value
