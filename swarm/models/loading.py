"""Finding a model by name or path and loading exactly the parts a process needs."""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from swarm.models import invariance
from swarm.models.checkpoint import CheckpointReader, Fetch, load_module, parse_dtype
from swarm.models.config import DEFAULT_MODEL, MODEL_DEFAULT_SETTINGS, ModelConfig
from swarm.models.formats import CheckpointFormat, detect_format
from swarm.models.hub import HubCheckpoint, HubName
from swarm.models.modules import BlockSpan, DiffusionTransformer, OutputHead, TokenEmbedding
from swarm.models.tokenizer import ByteTokenizer, HFTokenizer, SubwordTokenizer, Tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EXACT = "exact"  # a part computing in the checkpoint's own dtype, unquantized
GENERATION_DEFAULTS_FILE = "generation.json"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(name: str | torch.device) -> torch.device:
    """A torch device that exists here: a clear error for ``cuda`` without CUDA (instead of a failure deep
    inside the first forward pass), or for a GPU index this machine does not have."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"device {str(name)!r} is not a torch device ({error})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(name)!r}: CUDA is not available on this machine (torch "
                             f"{torch.__version__}, built for CUDA {torch.version.cuda}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(name)!r}: this machine has {torch.cuda.device_count()} CUDA devices")
        invariance.prepare_cuda()
    elif device.type != "cpu":
        raise ValueError(f"device {str(name)!r}: only cpu and cuda are supported")
    return device


def numerics(default: torch.dtype, dtype: torch.dtype, quant: Optional[str] = None) -> str:
    """How a part's numerics compare with the checkpoint's: ``exact``, or what differs (announced in a server's
    record, so that clients use such a server only when the user allows approximate servers)."""
    differences = []
    if dtype != default:
        differences.append(f"{dtype_name(dtype)} instead of the checkpoint's {dtype_name(default)}")
    if quant:
        differences.append(f"{quant} weights")
    return "; ".join(differences) or EXACT


def embedded_models() -> dict[str, Path]:
    """Models shipped inside the package, by name (the backbone ``default`` and the experts)."""
    found = {}
    for config in sorted(ASSETS.glob("*/config.json")):
        found[config.parent.name] = config.parent
    return found


@dataclass(frozen=True)
class ModelSource:
    """Where a named model's files are: a directory, and for a model named by repo id how to fetch the files of
    that directory a part needs that are not there yet."""

    path: Path
    fetch: Optional[Fetch] = None


# Resolves names this layer cannot (it knows no network): a source, or None when the name is not its kind.
Resolver = Callable[[str], Optional[ModelSource]]


def resolve_model(name_or_path: str | Path = DEFAULT_MODEL, resolvers: Sequence[Resolver] = ()) -> ModelSource:
    """The one way every command and loader names a model, tried in this order:

    * a checkpoint directory, used as is (``./ORG/NAME`` picks a local copy over the hub);
    * the name of a model embedded in the package (``default``, the experts);
    * a Hugging Face repo id, ``ORG/NAME`` or ``ORG/NAME@REVISION``: its config and tokenizer files are fetched
      now, its shards when a part needs them (:mod:`swarm.models.hub`);
    * then each of ``resolvers``: a swarm model id or published name (``swarm.weights.source.SwarmWeights``,
      given by callers that know the swarm): its manifest and small files come from peers now, its tensors
      when a part needs them.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return ModelSource(path)
    embedded = embedded_models()
    if str(name_or_path) in embedded:
        return ModelSource(embedded[str(name_or_path)])
    hub_name = HubName.parse(str(name_or_path))
    if hub_name is not None:
        checkpoint = HubCheckpoint(hub_name)
        return ModelSource(checkpoint.path, checkpoint.fetch)
    for resolver in resolvers:
        try:
            source = resolver(str(name_or_path))
        except ValueError as error:  # a published name that does not resolve: first say what the name was not
            raise type(error)(f"{not_embedded(str(name_or_path), embedded)}; as a published name: {error}") from error
        if source is not None:
            return source
    swarm = ", a swarm model id (64 hex digits), a published name (NAME or NAME@PUBLISHER)" if resolvers else ""
    raise FileNotFoundError(
        f"{not_embedded(str(name_or_path), embedded)}, and it is neither a checkpoint directory{swarm} nor a Hugging "
        f"Face repo id (ORG/NAME or ORG/NAME@REVISION)"
    )


def not_embedded(name: str, embedded: dict[str, Path]) -> str:
    """``model 'defualt' is no embedded model (did you mean 'default'? embedded: ...)``: the likeliest fix first,
    before any advice on checkpoint directories, repo ids or publishers."""
    close = difflib.get_close_matches(name, list(embedded), n=3, cutoff=0.6)
    guess = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    return f"model {name!r} is no embedded model ({guess}embedded: {', '.join(embedded) or 'none'})"


def resolve_model_path(name_or_path: str | Path = DEFAULT_MODEL) -> Path:
    """The directory of a named model (for a repo id: its config and tokenizer files, not its weights)."""
    return resolve_model(name_or_path).path


class ModelFiles:
    """A checkpoint directory: its config, a lazy tensor reader, and constructors for each part.

    The directory may be in the native format or in LLaDA's or Dream's published layout
    (:mod:`swarm.models.formats`); parts are built the same way for all, reading only their own tensors. For a
    model named by repo id only the shards holding those tensors are downloaded, when the part is built: a
    server's span fetches its blocks' shards (and the head's with ``--head``), a client the embedding's.
    """

    def __init__(self, name_or_path: str | Path = DEFAULT_MODEL, resolvers: Sequence[Resolver] = ()):
        source = resolve_model(name_or_path, resolvers)
        self.path = source.path
        self.format: CheckpointFormat = detect_format(self.path)
        self.config: ModelConfig = self.format.load_config(self.path)
        self.reader = CheckpointReader(self.path, rename=self.format.tensor_name, fetch=source.fetch)

    @property
    def default_dtype(self) -> torch.dtype:
        """The dtype every part computes in unless the user asks otherwise (local model, client and servers alike,
        so that default settings give the same tokens at every scale).

        LLaDA / Dream layouts: the checkpoint's ``torch_dtype`` (bfloat16 as published; float32 when it says so).
        The project's own (native) checkpoints are trained in float32 and only stored in half precision to stay
        small, so they compute in float32.
        """
        if self.format.name == "native":
            return torch.float32
        return parse_dtype(self.config.torch_dtype)

    def _dtype(self, dtype: Optional[str | torch.dtype]) -> torch.dtype:
        return parse_dtype(dtype) if dtype is not None else self.default_dtype

    def embedding(self, dtype: Optional[str | torch.dtype] = None) -> TokenEmbedding:
        return load_module(lambda: TokenEmbedding(self.config), self.reader, self._dtype(dtype))

    def span(self, start: int, end: int, dtype: Optional[str | torch.dtype] = None) -> BlockSpan:
        return load_module(lambda: BlockSpan(self.config, start, end), self.reader, self._dtype(dtype))

    def head(self, dtype: Optional[str | torch.dtype] = None) -> OutputHead:
        aliases = {"lm_head.weight": "embed.weight"} if self.config.tie_word_embeddings else None
        return load_module(lambda: OutputHead(self.config), self.reader, self._dtype(dtype), aliases)

    def full_model(self, dtype: Optional[str | torch.dtype] = None) -> DiffusionTransformer:
        parts = (self.embedding(dtype), self.span(0, self.config.num_layers, dtype), self.head(dtype))
        return DiffusionTransformer(self.config, parts).eval()

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampler settings the model reads best with (``generation.json``); a caller's own settings win.

        The local model and the swarm client read the same file, so default settings give the same tokens.
        Only the names are checked here; their values are checked as any setting is, when a model adopts them
        (``BaseDiffusionLM.sampling_defaults``).
        """
        path = self.path / GENERATION_DEFAULTS_FILE
        if not path.exists():
            return {}
        try:
            defaults = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as error:
            raise ValueError(f"{path} is not valid JSON ({error})") from None
        if not isinstance(defaults, dict) or set(defaults) - set(MODEL_DEFAULT_SETTINGS):
            raise ValueError(f"{path} may only set {', '.join(MODEL_DEFAULT_SETTINGS)}")
        return defaults

    def tokenizer(self) -> Tokenizer:
        if self.config.tokenizer == "byte":
            return ByteTokenizer()
        if self.config.tokenizer == "bpe":
            return SubwordTokenizer.from_file(self.path / SubwordTokenizer.FILE)
        return HFTokenizer.from_directory(
            self.path, fallback_class=self.format.tokenizer_fallback, mask_token_id=self.config.mask_token_id,
            pad_token_id=self.config.pad_token_id, eos_token_id=self.config.eos_token_id,
            vocab_size=self.config.vocab_size,
        )
