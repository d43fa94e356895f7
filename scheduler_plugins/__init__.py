"""Tessera scheduler plugins: the pure scheduling core and the adapters around it."""
