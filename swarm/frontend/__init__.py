"""The Python front end: what a user's script calls (``BaseDiffusionLM`` and its requests in ``lm.py`` and
``request.py``, the in-memory ``DiffusionLM`` in ``local.py``, scale by need in ``scale.py``); the swarm's
``DistributedDiffusionLM`` builds on ``BaseDiffusionLM`` in ``swarm/client/``."""
