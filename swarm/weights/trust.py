"""Whose names a caller follows: a published name resolves only through publishers the caller trusts (issue 48).

Anyone may sign a record under any name (``swarm-weights:name:{name}`` is a slot per Ed25519 key), so a name
read from the swarm says only "this key calls this id NAME". A caller follows the keys it trusts:

* by default the governance keys (``--governance-key``, else ``$SWARM_GOVERNANCE_KEYS``): the operators of a
  swarm publish its models' names, as they sign its halts;
* ``--trusted-publishers KEY[,KEY...]`` instead (base64 public keys or files holding one);
* ``--trusted-publishers none``: no name resolves; the model id is required.

``NAME@PUBLISHER`` names one publisher explicitly (16 hex digits of its key's SHA-256): the caller trusts it for
that reference. A stranger publishing a name first (squatting) or as well (a double claim) then changes nothing
for a default user: the stranger's record is not read as the name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from swarm.governance.keys import parse_public_key, public_key_text, trusted_key_texts
from swarm.utils.errors import EXIT_USAGE, SwarmError

NO_PUBLISHERS = "none"


class TrustError(SwarmError, ValueError):
    """A trusted publisher that is no Ed25519 public key, or ``none`` given with keys."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class PublisherTrust:
    """The publishers whose names resolve (base64 Ed25519 public keys); ``names`` False: none, the id is required."""

    keys: frozenset[str] = frozenset()
    names: bool = True
    source: str = "the governance keys"  # where the keys came from, for error messages

    @classmethod
    def of(cls, publishers: Iterable[str] = (), governance_keys: Iterable[str] = ()) -> "PublisherTrust":
        """``publishers`` (base64 keys or files; a value may hold several separated by commas or spaces; ``none``
        alone: trust none), else the governance keys (given, else ``$SWARM_GOVERNANCE_KEYS``). :class:`TrustError`
        naming a key that is not one."""
        texts = [part for text in publishers for part in str(text).replace(",", " ").split()]
        if texts == [NO_PUBLISHERS]:
            return cls(frozenset(), names=False, source="--trusted-publishers none")
        if NO_PUBLISHERS in texts:
            raise TrustError(f"trusted publishers: {NO_PUBLISHERS!r} (trust none) cannot go with keys")
        source = "--trusted-publishers" if texts else "the governance keys"
        texts = texts or trusted_key_texts(governance_keys)
        try:
            return cls(frozenset(public_key_text(parse_public_key(text)) for text in texts), True, source)
        except ValueError as error:
            raise TrustError(f"trusted publishers ({source}): {error}") from None

    def trusts(self, publisher: str) -> bool:
        return self.names and publisher in self.keys
