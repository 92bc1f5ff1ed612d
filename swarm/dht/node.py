"""Starting a hivemind DHT peer with the swarm's network options (one place for every command)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional

from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import RecordValidatorBase

from swarm.dht.identity import Identity
from swarm.dht.peers import resolve_initial_peers
from swarm.dht.validation import swarm_validators

logger = logging.getLogger(__name__)

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)


@dataclass
class NetworkConfig:
    """How a process joins the swarm; the defaults suit one machine (loopback only)."""

    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: list(LOOPBACK_MADDRS))
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: Optional[str] = None
    use_relay: bool = True
    use_auto_relay: bool = False
    client_mode: bool = False
    use_default_peers: bool = True  # fall back to $SWARM_INITIAL_PEERS and the bootstrap file


def start_dht(network: NetworkConfig, record_validators: Iterable[RecordValidatorBase] = (),
              identity: Optional[Identity] = None) -> DHT:
    """Start a DHT peer (with its libp2p daemon) and wait until it is ready.

    Every peer runs the swarm's record validators (``swarm.dht.validation``) and hivemind's
    ``RSASignatureValidator``, so storing peers refuse forged writes and readers strip the signatures. With an
    ``identity`` the daemon runs with that key and records are signed with it (what servers do); a temporary
    identity file is removed once the daemon has read it.
    """
    validators = [identity.validator] if identity is not None else []  # the first RSA validator is the one used
    validators += [*record_validators, *swarm_validators()]
    if not any(isinstance(v, RSASignatureValidator) for v in validators):
        validators.append(RSASignatureValidator())
    peers = resolve_initial_peers(network.initial_peers, use_defaults=network.use_default_peers)
    kwargs = dict(
        host_maddrs=network.host_maddrs, use_relay=network.use_relay, use_auto_relay=network.use_auto_relay,
        client_mode=network.client_mode,
    )
    if network.announce_maddrs:
        kwargs["announce_maddrs"] = network.announce_maddrs
    if identity is not None:
        kwargs["identity_path"] = str(identity.path)
        kwargs["check_if_identity_free"] = not identity.fresh  # a key made a moment ago cannot be in use
    elif network.identity_path:
        kwargs["identity_path"] = network.identity_path
    logger.info("starting DHT peer (%d initial peers)", len(peers))
    try:
        dht = DHT(initial_peers=peers or None, start=True, record_validators=validators, **kwargs)
    finally:
        if identity is not None:
            identity.remove()
    if identity is not None and str(dht.peer_id) != identity.peer_id:
        stop_dht(dht)
        raise RuntimeError(f"the DHT runs as {dht.peer_id}, not as its identity {identity.peer_id}")
    return dht


def visible_maddrs(dht: DHT) -> list[str]:
    return [str(addr) for addr in dht.get_visible_maddrs()]


def stop_dht(dht: DHT, timeout: float = 5.0) -> None:
    """Shut a DHT peer down, and make sure its process (and so its libp2p daemon) is really gone."""
    try:
        dht.shutdown()
    except Exception as error:  # shutting down a half-dead peer must not stop the rest of the cleanup
        logger.warning("DHT shutdown failed: %s", error)
    if dht.is_alive():
        dht.join(timeout)
    if dht.is_alive():
        logger.warning("DHT process did not stop in %.0f s; terminating it", timeout)
        dht.terminate()
        dht.join(timeout)
