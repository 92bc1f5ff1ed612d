"""Masked-diffusion sampling and expert composition: pure torch, never imports the network.

The names below are imported on first use (:mod:`swarm.utils.lazy`): the settings modules import no torch.
"""
from swarm.utils.lazy import lazy_exports

_EXPORTS = {
    "GenerationConfig": "swarm.diffusion.config", "STRATEGIES": "swarm.diffusion.remasking",
    "Pending": "swarm.diffusion.denoiser", "PipelinedDenoiser": "swarm.diffusion.denoiser",
    **{name: "swarm.diffusion.sampler"
       for name in ("DenoiseContext", "Denoiser", "DiffusionSampler", "SamplerStats", "StepEvent")},
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
