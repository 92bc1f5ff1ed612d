"""A peer-to-peer swarm that runs masked-diffusion language models across volunteers' machines."""
from swarm.diffusion.config import GenerationConfig
from swarm.lm import GenerationResult, StreamChunk
from swarm.local import DiffusionLM
from swarm.version import __version__

__all__ = ["__version__", "DiffusionLM", "GenerationConfig", "GenerationResult", "StreamChunk"]
