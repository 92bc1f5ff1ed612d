"""Models named by Hugging Face repo id (``ORG/NAME`` or ``ORG/NAME@REVISION``), fetched part by part.

A volunteer types the repo id instead of copying 16 GB by hand. Every process pins the revision to one commit
when it starts (so all its files come from the same commit), fetches the config and the tokenizer files at once,
and each shard of weights only when a part it loads needs a tensor in it: a server of blocks 0:8 downloads the
shards holding blocks 0:8, a client the embedding's shard (and the head's, if it ever scores itself).

Everything goes through ``huggingface_hub`` (``hf_hub_download`` per file), so the usual cache (``HF_HOME``),
offline mode (``HF_HUB_OFFLINE``), resumed downloads, tokens (``HF_TOKEN``), mirrors (``HF_ENDPOINT``) and
progress bars behave as with any Hugging Face tool. Every failure becomes one :class:`ModelFetchError` line
that says what to change.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

# Only the constants at import (a few ms): hf_hub_download and the hub's errors pull in its HTTP client (~0.15 s),
# which every server and client would pay at start although only a model named by repo id downloads anything.
from huggingface_hub import constants

from swarm.models.checkpoint import INDEX_FILE
from swarm.models.config import CONFIG_FILE
from swarm.utils.errors import EXIT_USAGE, SwarmError
from swarm.utils.text import plural

logger = logging.getLogger(__name__)

DEFAULT_REVISION = "main"
# Small files every role reads: weights index, the project's sampler defaults, and tokenizer files in any of the
# layouts transformers writes. Absent ones are remembered by the cache (``.no_exist``), so offline runs skip them.
OPTIONAL_FILES = (
    INDEX_FILE, "generation.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
    "chat_template.json",
)
# ORG/NAME as the hub spells repo ids (letters, digits, '-', '_', '.'), then an optional @REVISION (a branch,
# tag or commit; a branch may contain '/', as in refs/pr/1).
HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@]+))?$")


class ModelFetchError(SwarmError, ValueError):
    """A model named by repo id whose files could not be fetched: a missing or gated repo, a revision that does
    not exist, a file missing from the repo or (offline) from the cache, an unreachable hub, a full disk."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class HubName:
    """``ORG/NAME@REVISION`` split in two."""

    repo_id: str
    revision: str = DEFAULT_REVISION

    @classmethod
    def parse(cls, name: str) -> Optional["HubName"]:
        """The repo id and revision named, or None when ``name`` is not spelled like one."""
        match = HUB_NAME.match(name)
        if not match or ".." in name or "--" in match["repo"]:
            return None
        return cls(match["repo"], match["revision"] or DEFAULT_REVISION)

    @property
    def model_name(self) -> str:
        return self.repo_id.split("/", 1)[1]

    def __str__(self) -> str:
        return self.repo_id if self.revision == DEFAULT_REVISION else f"{self.repo_id}@{self.revision}"


def fetch_error(name: HubName, filename: str, error: Exception) -> ModelFetchError:
    """One line saying why ``filename`` of ``name`` could not be had, and what to do about it."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{constants.ENDPOINT}/{name.repo_id}"
    if isinstance(error, LocalEntryNotFoundError):  # before the others: the cache was the only place to look
        if constants.HF_HUB_OFFLINE:
            return ModelFetchError(f"model {name}: {filename} is not in the Hugging Face cache "
                                   f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: fetch it once online")
        return ModelFetchError(f"model {name}: cannot reach the hub at {constants.ENDPOINT} and {filename} is not "
                               f"in the cache ({constants.HF_HUB_CACHE}): check the network, HF_ENDPOINT or a proxy")
    if isinstance(error, GatedRepoError):  # a subclass of RepositoryNotFoundError
        return ModelFetchError(f"model {name.repo_id} is gated: accept its terms at {where} and log in "
                               f"(`hf auth login` or HF_TOKEN)")
    if isinstance(error, RepositoryNotFoundError):
        return ModelFetchError(f"model {name.repo_id!r} is neither a directory here nor a repository on "
                               f"{constants.ENDPOINT} (a private repo needs `hf auth login` or HF_TOKEN)")
    if isinstance(error, RevisionNotFoundError):
        return ModelFetchError(f"model {name.repo_id} has no revision {name.revision!r} (a branch, tag or commit)")
    if isinstance(error, RemoteEntryNotFoundError):
        return ModelFetchError(f"model {name} has no file {filename!r} at {where}")
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return ModelFetchError(f"model {name}: no space left on the disk of {constants.HF_HUB_CACHE} while "
                               f"fetching {filename}: free some, or point HF_HOME at a larger disk")
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else "no"
        return ModelFetchError(f"model {name}: the hub at {constants.ENDPOINT} answered {status} for {filename}")
    return ModelFetchError(f"model {name}: fetching {filename} failed: {type(error).__name__}: {error}")


def download(name: HubName, filename: str, revision: str) -> Path:
    """One file of the repo at ``revision`` into the Hugging Face cache (a dropped connection is resumed with a
    byte range; a file already there is not fetched again)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(name.repo_id, filename, revision=revision))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
        raise fetch_error(name, filename, error) from error


class HubCheckpoint:
    """A repo pinned at one commit, with its small files here and its shards fetched when asked for.

    ``path`` is a directory named after the model (so the swarm's default DHT prefix is ``NAME``, as for a
    local copy of the repo) that shows the cache's snapshot of that commit; :meth:`fetch` fills it in.
    """

    def __init__(self, name: HubName):
        self.name = name
        config = download(name, CONFIG_FILE, name.revision)  # resolves a branch or tag to its commit
        self.snapshot = config.parent
        self.commit = self.snapshot.name
        for filename in OPTIONAL_FILES:
            self._download_optional(filename)
        self.path = named_view(self.snapshot, name)
        logger.info("model %s is commit %s; files in %s", name, self.commit, self.snapshot)

    def _download_optional(self, filename: str) -> None:
        """A file the repo may lack: fetched if present, skipped if the hub (or the cache's memory of it) says
        absent, and skipped offline when the cache knows nothing of it."""
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RemoteEntryNotFoundError

        if try_to_load_from_cache(self.name.repo_id, filename, revision=self.commit) is not None:
            return  # cached, or cached as absent
        try:
            hf_hub_download(self.name.repo_id, filename, revision=self.commit)
        except RemoteEntryNotFoundError:
            pass
        except LocalEntryNotFoundError:
            logger.debug("model %s: %s is not cached and the hub is out of reach; going without it", self.name,
                         filename)
        except (HfHubHTTPError, OSError) as error:
            raise fetch_error(self.name, filename, error) from error

    def fetch(self, filenames: Sequence[str]) -> None:
        """Bring the files a part needs (shards) into the snapshot, logging how many bytes came and how fast."""
        missing = [f for f in dict.fromkeys(filenames) if not (self.snapshot / f).exists()]
        if not missing:
            return
        logger.info("fetching %s of %s from %s: %s", plural(len(missing), "file"), self.name, constants.ENDPOINT,
                    ", ".join(missing))
        started, total = time.monotonic(), 0
        for filename in missing:
            total += download(self.name, filename, self.commit).stat().st_size
        seconds = max(time.monotonic() - started, 1e-6)
        logger.info("fetched %.1f MB of %s in %.1f s (%.1f MB/s)", total / 1e6, self.name, seconds,
                    total / 1e6 / seconds)


def named_view(snapshot: Path, name: HubName) -> Path:
    """``$HF_HOME/swarm/models/ORG--NAME/COMMIT/NAME``, a link to the snapshot directory.

    The link's name is the model's, so everything that names a swarm after its model's directory (servers,
    clients, the API, swarm.health) agrees on ``NAME`` whether a peer has a copy of the repo or its id. Where
    links cannot be made the snapshot itself is used (the DHT prefix is then the commit: pass --dht-prefix).
    """
    view = Path(constants.HF_HOME) / "swarm" / "models" / name.repo_id.replace("/", "--") / snapshot.name
    link = view / name.model_name
    if link.is_dir() and link.resolve() == snapshot.resolve():
        return link
    try:
        view.mkdir(parents=True, exist_ok=True)
        temporary = view / f".{name.model_name}.{os.getpid()}"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(snapshot, target_is_directory=True)
        os.replace(temporary, link)  # atomic: two processes starting together both end with a good link
    except OSError as error:
        logger.warning("cannot link %s as %s (%s): using the snapshot directory; its DHT prefix is the commit id",
                       snapshot, link, error)
        return snapshot
    return link
