"""``python -m swarm.advise``: which blocks a joining server should host, the built-in rule's proposal beside a
``host-blocks`` model's, each checked and scored (docs/OPERATIONS.md, issue 57)."""
