"""Governance: a signed kill switch on the DHT that servers and clients obey (``python -m swarm.governance``)."""
