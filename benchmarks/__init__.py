"""Reproducible benchmarks of Tessera's scheduling core (``python -m benchmarks.<name>``)."""
