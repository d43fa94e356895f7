"""Tessera's mutating admission webhook for pods (SPEC §6).

A pure core decides (``review``: the AdmissionReview envelope, ``rules``: what a pod may ask
and what Tessera fills in, ``facts``: what the cluster's GPUs can hold), and thin adapters
serve it: ``server`` (HTTPS), ``app`` (node watch + server), ``certs`` (self-signed serving
certificates), ``manifest`` (the MutatingWebhookConfiguration) and ``cli``
(``tessera webhook serve|certs|manifest``).
"""
