"""Which servers serve which blocks of a model: the health map (``python -m swarm.health``)."""
from swarm.health.map import (
    ExpertAnnouncement,
    HealthMap,
    build_health_map,
    format_spans,
    read_experts,
    read_health_map,
)

__all__ = ["ExpertAnnouncement", "HealthMap", "build_health_map", "format_spans", "read_experts",
           "read_health_map"]
