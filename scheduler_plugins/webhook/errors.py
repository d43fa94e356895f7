"""Errors of the admission webhook, named by what the caller should do."""

from __future__ import annotations

from api.errors import InvalidInputError


class MalformedReviewError(InvalidInputError):
    """The body is not an ``admission.k8s.io/v1`` AdmissionReview request: answer HTTP 400."""


class WebhookSetupError(InvalidInputError):
    """A flag, address or certificate file cannot be used; the message says what to change."""
