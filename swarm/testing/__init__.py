"""Harnesses that the tests and the scripts in ``benchmarks/`` share, defined once here instead of in ``tests/``.

* :mod:`swarm.testing.checkpoints`: a tiny native checkpoint with random weights (``tiny_config``,
  ``make_checkpoint``).

Nothing else in the package imports them: they sit with the entry points at the top of the layer table
(``docs/ARCHITECTURE.md``), and may use any layer below. Submodules are imported by name; this file imports none of
them, so importing one loads only what it needs.
"""
