"""Kubelet device plugin API."""
