"""`loraserve serve --replicas N` / `--ray-address ADDR`: Ray, Serve, the app, until a signal
(then teardown.py drains the app and stops Ray).

Without --ray-address a local Ray instance is started with a small footprint (no dashboard, a
small object store: only requests and answers cross it) sized to the replicas asked for; with
it, the command joins that cluster and Ray places the replicas where CPUs are free.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Callable

from loraserve.cluster.spec import APP_NAME, ClusterSpec
from loraserve.cluster.teardown import stop_serving
from loraserve.config.openmp import SERVING_OPENMP_ENV

log = logging.getLogger("loraserve.cluster")
OBJECT_STORE_BYTES = 128 * 1024 * 1024  # Ray's floor is 75 MiB
# how long the driver's last task events may take to reach the GCS as it disconnects: they
# feed only Ray's dashboard, which a local instance runs without, and Ray's default makes the
# driver wait seconds for a GCS that a signal to the whole process group has already stopped
TASK_EVENTS_FLUSH_MS = 250


def start_ray(spec: ClusterSpec, log_to_driver: bool = True) -> None:
    import ray

    cl = spec.cluster
    # replicas step their engine on a thread of their own, as a direct server does
    openmp = {k: os.environ.get(k, v) for k, v in SERVING_OPENMP_ENV.items()}
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", **openmp}}
    if cl.ray_address:
        ray.init(address=cl.ray_address, runtime_env=env, log_to_driver=log_to_driver)
        return
    cpus = max(os.cpu_count() or 1, math.ceil(cl.replicas * cl.replica_cpus))
    ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
             runtime_env=env, log_to_driver=log_to_driver,
             _system_config={"task_events_shutdown_flush_timeout_ms": TASK_EVENTS_FLUSH_MS})


def deploy(spec: ClusterSpec, host: str, port: int, name: str = APP_NAME) -> None:
    """Start Serve's HTTP proxy on host:port and run the app (returns once it is ready)."""
    from ray import serve

    from loraserve.cluster.app import build_from_spec

    serve.start(http_options={"host": host, "port": port})
    serve.run(build_from_spec(spec), name=name, route_prefix="/", blocking=False)


def serve_cluster(spec: ClusterSpec, host: str, port: int,
                  on_ready: Callable[[], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM, then drain (teardown.py); `on_ready` runs once every
    replica is up and the proxy listens. A second signal stops waiting for the drain."""
    start_ray(spec)
    stop = threading.Event()

    def on_signal(*_) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        deploy(spec, host, port)
        log.info("serving %d replicas on http://%s:%d (routing: %s)", spec.cluster.replicas,
                 host, port, spec.cluster.routing)
        if on_ready is not None:
            on_ready()
        stop.wait()
    except KeyboardInterrupt:  # a second signal while the app was still starting
        pass
    finally:
        log.info("shutting down the replicas")
        stop_serving(spec)
    return 0
