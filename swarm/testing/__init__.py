"""Harnesses that the tests and the scripts in ``benchmarks/`` share, defined once here instead of in ``tests/``.

* :mod:`swarm.testing.adapters`: random soft prompts of chosen quality (``random_soft_prompt``);
* :mod:`swarm.testing.checkpoints`: a tiny native checkpoint with random weights (``tiny_config``,
  ``make_checkpoint``);
* :mod:`swarm.testing.hub_standin`: a stand-in for the Hugging Face hub's file endpoint on 127.0.0.1;
* :mod:`swarm.testing.netlab`: a small internet of network namespaces for NAT tests and benchmarks (root only);
* :mod:`swarm.testing.silent_delivery`: a client that never reads what servers push to it.

Nothing else in the package imports them: they sit with the entry points at the top of the layer table
(``docs/ARCHITECTURE.md``), and may use any layer below. Submodules are imported by name; this file imports none of
them, so importing one loads only what it needs.
"""
