"""A client that never reads what servers push to it: used by the push-bound tests and benchmarks/server_bounds.py."""
from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from swarm.wire.services import DeliveryService


async def add_silent_delivery(p2p: P2P, namespace: str) -> str:
    """Register a delivery handler under ``namespace`` that accepts each stream and never reads it."""

    async def never_read(info, reader, writer) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # the peer shuts down
            pass

    await p2p.add_binary_stream_handler(DeliveryService._get_handle_name(namespace, "rpc_deliver"), never_read)
    return namespace
