"""The HAMi wire contract: what Tessera's scheduler and node agent (and HAMi's own components)
read and write on Kubernetes objects.

- ``keys``: annotation and label keys, closed value sets (modes, bind phases);
- ``policy``: the scheduling policy names pods and the device config choose from;
- ``register``: ``hami.io/node-nvidia-register`` (the node's GPUs), byte-exact with HAMi;
- ``devices``: the pod's device strings and MIG allocations;
- ``matching``: which allocating pod a node agent can tell apart from another;
- ``config``: the device ConfigMap (HAMi's keys plus Tessera's ``scheduler`` section);
- ``catalog``: facts of GPU models (what the simulated NVML backend serves).

Pure: no I/O, no clock, no Kubernetes client.
"""
