"""Kubelet PodResources API v1 (generated from api.proto by hack/gen-protos.sh)."""
