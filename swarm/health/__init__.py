"""Which servers serve which blocks of a model: the health map (``python -m swarm.health``).

The names below are imported on first use (:mod:`swarm.utils.lazy`): the map reads the DHT (hivemind), and
``python -m swarm.health --help`` imports this package first.
"""
from swarm.utils.lazy import lazy_exports

_EXPORTS = {name: "swarm.health.map" for name in ("ExpertAnnouncement", "HealthMap", "build_health_map",
                                                  "format_spans", "read_experts", "read_health_map")}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
