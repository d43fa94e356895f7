"""Every wire Tessera speaks, and the code that speaks it; nothing here imports Tessera's
components.

- ``plugin/v1``: the plugin protocol between the Go shim and the plugin server (generated);
- ``deviceplugin/v1beta1``: the kubelet device plugin API (generated);
- ``hami``: the HAMi contract on Kubernetes objects (annotations, codecs, device config);
- ``kube``: the one Kubernetes API client, and readers of API objects;
- ``errors``: the error hierarchy every component raises; ``sockets``: Unix-socket endpoints.

Regenerate the protocol code with ``hack/gen-protos.sh``.
"""
