"""A peer-to-peer swarm that runs masked-diffusion language models across volunteers' machines.

``swarm.DiffusionLM`` and the other names below are imported on first use (:mod:`swarm.utils.lazy`), so that a
command such as ``python -m swarm.server --help`` answers before torch is loaded.
"""
import os

from swarm.utils.lazy import defer_import, lazy_exports
from swarm.version import __version__

# Before anything imports hivemind (every module of this package passes here first):
# - hivemind has torch share memory through named files in /dev/shm ("file_system"), and every process that makes an
#   MPFuture (each server, client and DHT) left its file there for good: 4 KB of memory per command run, until the
#   machine restarts. Shared by file descriptor, a segment is unlinked once made;
# - hivemind imports scipy.optimize at start for its averager's load balancing, which only collaborative fine-tuning
#   runs (0.3 s of every start).
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
defer_import("scipy.optimize")

_EXPORTS = {
    "DiffusionLM": "swarm.frontend.local", "GenerationConfig": "swarm.diffusion.config",
    "GenerationResult": "swarm.frontend.lm", "StreamChunk": "swarm.frontend.lm", "SwarmError": "swarm.utils.errors",
}
__all__ = ["__version__", *_EXPORTS]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
