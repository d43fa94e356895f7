"""Tessera node agent: GPU discovery, registration and MIG realization on one node."""
