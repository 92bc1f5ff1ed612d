"""Model pieces (embedding, block spans, head), configs, checkpoints and tokenizers."""
from swarm.models.config import ModelConfig
from swarm.models.loading import DEFAULT_MODEL, ModelFiles, embedded_models, resolve_model_path
from swarm.models.modules import BlockSpan, DiffusionTransformer, OutputHead, TokenEmbedding
from swarm.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "ModelConfig", "DEFAULT_MODEL", "ModelFiles", "embedded_models", "resolve_model_path", "BlockSpan",
    "DiffusionTransformer", "OutputHead", "TokenEmbedding", "ByteTokenizer", "HFTokenizer", "Tokenizer",
]
