"""Scale-out: N loraserve engines as Ray Serve replicas behind one OpenAI-compatible ingress.

Ray is an optional dependency (`pip install loraserve[cluster]`): nothing outside this package
imports it, and `loraserve serve` imports this package only with --replicas > 1 or
--ray-address. Each replica runs the single server's own app (server/app.py) in-process; the
ingress forwards requests to it, so routes, errors and streams are the single server's.
"""
