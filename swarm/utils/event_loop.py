"""A background asyncio loop so that synchronous user code can call hivemind's async P2P API."""
from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Optional, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """One event loop in a daemon thread; ``run`` submits a coroutine and waits for its result.

    Clients share one process-wide loop (:meth:`shared`): hivemind caches one P2P replica per DHT, and a
    replica only works on the loop it was created on.
    """

    _shared: Optional["BackgroundLoop"] = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> "BackgroundLoop":
        with cls._shared_lock:
            if cls._shared is None or not cls._shared.loop.is_running():
                cls._shared = cls(name="swarm-shared-loop")
            return cls._shared

    def __init__(self, name: str = "swarm-client-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Awaitable[T], timeout: Optional[float] = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        """Cancel what is still running (e.g. P2P readers), then stop and close the loop."""
        if not self.loop.is_running():
            return
        try:
            self.run(_cancel_other_tasks(), timeout=5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
            if not self.loop.is_running():
                self.loop.close()


async def _cancel_other_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
