"""The plugin server: the gRPC face of the scheduling core for the Go kube-scheduler shim.

- ``cache``: the cluster model fed by watches, plus reservations and bind claims.
- ``watch``: list+watch loops that keep the cache current and say when it is ready.
- ``servicer``: translates plugin-protocol messages to core calls and back.
- ``events``: Kubernetes Events that explain pending GPU pods.
- ``app``: wires them together and serves on a Unix socket (or loopback TCP).
"""
