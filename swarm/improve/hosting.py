"""A trainer serves the files of the versions it publishes itself: the server's adapter RPC (``rpc_adapter_files``)
on the trainer's own peer, and the same announcement servers make (``{prefix}.adapters.hosts.{sha256}`` under its
owner subkey), so a client or an auditor fetches a new version from its trainer and checks it against its hash."""
from __future__ import annotations

import logging
from pathlib import Path

from hivemind.dht import DHT

from swarm.adapters.sharing import AdapterLibrary, content_hash, declare_hosted, read_adapter_files
from swarm.dht.identity import Identity
from swarm.dht.schema import now
from swarm.server.handler import ForwardHandler
from swarm.utils.event_loop import BackgroundLoop

logger = logging.getLogger(__name__)


class VersionHost:
    """Serves adapter directories by content hash from ``dht``'s peer (blocks: none; forward calls are refused)."""

    def __init__(self, dht: DHT, identity: Identity, prefix: str, hidden_size: int, lifetime: float):
        self.dht, self.identity, self.prefix, self.lifetime = dht, identity, prefix, lifetime
        self.library = AdapterLibrary()
        self.handler = ForwardHandler(None, hidden_size=hidden_size, max_batch_tokens=64, wire_dtype="auto",
                                      request_timeout=30.0, info=dict)
        self.handler.adapters = self.library
        self.loop = BackgroundLoop.shared()
        self.p2p = self.loop.run(dht.replicate_p2p())
        self.loop.run(self.handler.add_p2p_handlers(self.p2p))
        self.addresses = [str(a).rsplit("/p2p/", 1)[0] for a in self.loop.run(self.p2p.get_visible_maddrs())]

    def serve(self, directory: Path) -> str:
        """Serve the adapter in ``directory`` (its files checked); its content hash."""
        files = read_adapter_files(directory)
        sha = content_hash(files)
        self.library.files[sha] = files
        self.announce()
        return sha

    def drop(self, sha256: str) -> None:
        self.library.files.pop(sha256, None)

    def announce(self) -> None:
        """Announce every content served (again: the announcement expires after ``lifetime``)."""
        if self.library.files and not declare_hosted(self.dht, self.prefix, self.library.sizes,
                                                     self.identity.owner_subkey(), now() + self.lifetime,
                                                     self.addresses):
            logger.warning("the swarm did not take the announcement of this trainer's versions")

    def close(self) -> None:
        """Stop serving and close this host's own connection to the P2P daemon (its tasks would otherwise be
        destroyed pending at exit, with a traceback each); a second call does nothing. For the end of a run only:
        closing one connection to a hivemind daemon ends the calls of every other over it."""
        if self.p2p is None:
            return
        p2p, self.p2p = self.p2p, None
        try:
            self.loop.run(self.handler.remove_p2p_handlers(p2p))
        finally:
            self.loop.run(p2p.shutdown(), timeout=5)
