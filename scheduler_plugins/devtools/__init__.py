"""Developer tooling: the local cluster, ``tessera demo``, ``tessera bench`` and ``tessera
check``. Product code never imports this package (the import contract test holds it)."""
