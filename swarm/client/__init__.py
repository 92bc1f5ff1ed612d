"""The user side of the swarm: ``DistributedDiffusionLM`` and its settings."""
from swarm.client.config import ClientConfig
from swarm.client.model import DistributedDiffusionLM
from swarm.client.routing import MissingBlocksError, RouteHop
from swarm.client.sequence import SwarmError

__all__ = ["ClientConfig", "DistributedDiffusionLM", "MissingBlocksError", "RouteHop", "SwarmError"]
