"""The user side of the swarm: ``DistributedDiffusionLM`` and its settings."""
from swarm.client.config import ClientConfig
from swarm.client.failover import SwarmError
from swarm.client.model import DistributedDiffusionLM
from swarm.client.routing import MissingBlocksError, RouteHop

__all__ = ["ClientConfig", "DistributedDiffusionLM", "MissingBlocksError", "RouteHop", "SwarmError"]
