"""Training the project's own small models (``python -m swarm.train``)."""
