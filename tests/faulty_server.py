"""A deliberately faulty server for the spot-check tests (never a production flag).

Runs the real ``python -m swarm.server`` CLI with the backend's output perturbed by noise of 5% of its
scale: plausible-looking but wrong hidden states, as a dishonest or broken volunteer would return.
"""
import torch

from swarm.server import backend

_honest_forward = backend.SpanBackend.forward_sync


def _perturbed_forward(self, hidden, start, end, kv=None, rows=None):
    output = _honest_forward(self, hidden, start, end, kv, rows)
    return output + 0.05 * output.std() * torch.randn_like(output)


backend.SpanBackend.forward_sync = _perturbed_forward

if __name__ == "__main__":
    from swarm.server.__main__ import main

    main()
