"""Masked-diffusion sampling and expert composition: pure torch, never imports the network."""
from swarm.diffusion.config import GenerationConfig
from swarm.diffusion.denoiser import Pending, PipelinedDenoiser
from swarm.diffusion.remasking import STRATEGIES
from swarm.diffusion.sampler import DenoiseContext, Denoiser, DiffusionSampler, SamplerStats, StepEvent

__all__ = ["GenerationConfig", "STRATEGIES", "DenoiseContext", "Denoiser", "DiffusionSampler", "Pending",
           "PipelinedDenoiser", "SamplerStats", "StepEvent"]
