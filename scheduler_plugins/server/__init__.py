"""The plugin server: the gRPC face of the scheduling core for the Go kube-scheduler shim.

- ``watch``: list+watch loops that keep the core's cluster model (``core.cache``) current and
  say when it is ready.
- ``servicer``: translates plugin-protocol messages to the reservation lifecycle
  (``core.reservations``) and back.
- ``events``: Kubernetes Events that explain pending GPU pods; ``metrics``, ``tracing``.
- ``app``: wires them together and serves on a Unix socket (or loopback TCP); ``cli``.
"""
