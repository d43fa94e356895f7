"""The kubelet device plugin (API v1beta1): device ids, the servicer and its registration."""
