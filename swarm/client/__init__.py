"""The user side of the swarm: ``DistributedDiffusionLM`` and its settings (imported on first use, so that
reading ``swarm.client.config`` loads neither torch nor hivemind)."""
from swarm.utils.lazy import lazy_exports

_EXPORTS = {
    "ClientConfig": "swarm.client.config", "DistributedDiffusionLM": "swarm.client.model",
    "MissingBlocksError": "swarm.client.routing", "RouteHop": "swarm.client.routing",
    "SwarmError": "swarm.utils.errors",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
