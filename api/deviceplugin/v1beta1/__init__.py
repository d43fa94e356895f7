"""Kubelet device plugin API v1beta1 (generated from api.proto by hack/gen-protos.sh)."""
