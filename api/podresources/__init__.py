"""Kubelet PodResources API (which devices each container was given)."""
