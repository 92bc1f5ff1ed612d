"""Hosting a span of blocks: ``python -m swarm.server --blocks 0:16``."""
