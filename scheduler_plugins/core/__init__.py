"""The scheduling core: plain Python over numpy, no gRPC, Kubernetes client, tracing or clock.

The plugin server, ``tessera simulate``, the webhook and the benchmarks call it directly.
"""
