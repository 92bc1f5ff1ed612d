"""An OpenAI-style HTTP API in front of a diffusion LM, local or distributed (``python -m swarm.api``).

FastAPI and uvicorn come with the package's own requirements (``pip install -e .``); the api extra
(``pip install -e ".[api]"``) names the same packages, for older install lines. The names below are imported on
first use (:mod:`swarm.utils.lazy`), so that ``python -m swarm.api --help`` answers before torch loads.
"""
from swarm.utils.lazy import lazy_exports

_EXPORTS = {"GenerationEngine": "swarm.api.engine", "create_app": "swarm.api.app", "load_engine": "swarm.api.engine"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
