"""How `serve --replicas N` stops: drain the app while Ray can, then end Ray promptly.

A signal to the command alone (docker stop, Ctrl-C: Ray's own processes ignore SIGINT) leaves
Ray running, so the app is drained as a single server drains: deleting it makes each replica
stop taking requests and wait for the ones in flight, up to --shutdown-timeout (the
deployments' graceful_shutdown_timeout_s, app.py), while Serve's proxy stays to relay them.

A SIGTERM to the whole process group or cgroup (systemd, `kill -- -PGID`) reaches the local
instance's GCS and raylet too. They stop serving at once, so Serve's controller can no longer
delete anything and there is nothing left to drain; yet they do not exit (the workers outlive
the signal, and the GCS and raylet linger beside them) until ray.shutdown() kills them, after
a grace period for each. So when the GCS no longer answers, a local instance's processes are
ended without one.
"""

from __future__ import annotations

import logging
import socket
import time

from loraserve.cluster.spec import APP_NAME, ClusterSpec

log = logging.getLogger("loraserve.cluster")
# how long after the signal the GCS is watched: one that got it too closes its port at once
GCS_SETTLE_S = 0.2
_POLL_S = 0.05
# the app's drain (app.py: --shutdown-timeout, then the ingress's grace) plus Serve's rounds
DELETE_MARGIN_S = 15.0


def stop_serving(spec: ClusterSpec, name: str = APP_NAME) -> None:
    """Drain and delete the app (while Ray can), then disconnect from Ray; a local instance
    goes with it, replicas and all."""
    import ray

    gcs = _gcs_address()
    up = True
    try:
        if gcs is not None:
            up = gcs_answers(gcs)
        if up:
            # Serve force-stops a replica after its graceful_shutdown_timeout_s: past that
            # and a few control-loop rounds, something is wrong that waiting will not mend
            up = _drain(name, gcs, spec.shutdown_timeout_s + DELETE_MARGIN_S)
    except KeyboardInterrupt:  # a second signal: stop waiting for requests in flight
        log.warning("second signal: not waiting for the requests in flight")
    if not up and not spec.cluster.ray_address:
        log.warning("Ray's own processes got the signal too (it was sent to the whole "
                    "process group): requests in flight cannot be drained")
        _end_local_processes()
    ray.shutdown()


def _drain(name: str, gcs: str | None, budget_s: float) -> bool:
    """Delete app `name` and wait until Serve no longer lists it (Serve's own blocking delete
    looks once a second, longer than an idle app takes to stop); False if the GCS stopped
    answering meanwhile."""
    from ray import serve

    deadline = time.monotonic() + budget_s
    try:
        serve.delete(name, _blocking=False)
        while name in serve.status().applications:
            if gcs is not None and not gcs_answers(gcs, settle_s=0):
                return False
            if time.monotonic() >= deadline:
                log.warning("the app was not deleted in time; stopping anyway")
                break
            time.sleep(_POLL_S)
    except Exception as e:  # the cluster may be going away on its own
        log.warning("could not delete the app: %s", e)
        return gcs is None or gcs_answers(gcs, settle_s=0)
    return True


def _gcs_address() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # a connection without one of its own (Ray Client): not checked
        return None


def gcs_answers(address: str, settle_s: float = GCS_SETTLE_S) -> bool:
    """Whether the GCS at host:port keeps taking connections for `settle_s` seconds."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + settle_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
        except OSError:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(_POLL_S)


def _end_local_processes() -> None:
    """The local instance's processes (GCS, raylet, agents), killed without the grace period
    ray.shutdown() would give each; their workers exit once the raylet is gone."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    kill = getattr(node, "kill_all_processes", None)
    if kill is None:  # another Ray's internals: ray.shutdown() alone, with its grace periods
        return
    try:
        kill(check_alive=False, allow_graceful=False, wait=True)
    except Exception as e:  # ray.shutdown() still tries them after this
        log.warning("could not end Ray's processes: %s", e)
