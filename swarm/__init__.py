"""A peer-to-peer swarm that runs masked-diffusion language models across volunteers' machines."""
__version__ = "0.1.0"

from swarm.diffusion.config import GenerationConfig
from swarm.lm import GenerationResult, StreamChunk
from swarm.local import DiffusionLM

__all__ = ["__version__", "DiffusionLM", "GenerationConfig", "GenerationResult", "StreamChunk"]
