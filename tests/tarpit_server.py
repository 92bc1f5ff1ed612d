"""A fake server for the security tests (never a production flag): it announces its span like any other and
answers pings, but holds forward calls without answering, as an attacker's tarpit would.

By default it holds every forward call; started with ``--public-name tarpit-large`` it answers one-token calls
(so it passes the client's compute challenge) and holds the rest.
"""
import sys
import time

from swarm.server import backend

_honest_forward = backend.SpanBackend.forward_sync
LARGE_ONLY = "tarpit-large" in sys.argv


def _tarpit_forward(self, call, *rest, **options):
    if not LARGE_ONLY or call.hidden.shape[0] * call.hidden.shape[1] > 1:
        time.sleep(3600)
    return _honest_forward(self, call, *rest, **options)


backend.SpanBackend.forward_sync = _tarpit_forward

if __name__ == "__main__":
    from swarm.server.__main__ import main

    main()
