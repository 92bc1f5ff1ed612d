"""An OpenAI-style HTTP API in front of a diffusion LM, local or distributed (``python -m swarm.api``).

Needs FastAPI and uvicorn; everything else in the project works without them.
"""
from swarm.api.app import create_app
from swarm.api.engine import GenerationEngine, load_engine

__all__ = ["GenerationEngine", "create_app", "load_engine"]
