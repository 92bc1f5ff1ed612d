"""Model pieces (embedding, block spans, head), configs, checkpoints and tokenizers (imported on first use: the
package itself loads no torch)."""
from swarm.utils.lazy import lazy_exports

_EXPORTS = {
    "ModelConfig": "swarm.models.config", "DEFAULT_MODEL": "swarm.models.config",
    **{name: "swarm.models.loading" for name in ("ModelFiles", "embedded_models", "resolve_model_path")},
    **{name: "swarm.models.modules" for name in ("BlockSpan", "DiffusionTransformer", "OutputHead", "TokenEmbedding")},
    **{name: "swarm.models.tokenizer" for name in ("ByteTokenizer", "HFTokenizer", "Tokenizer")},
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
