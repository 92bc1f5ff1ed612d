"""A deliberately faulty server for the spot-check tests (never a production flag).

Runs the real ``python -m swarm.server`` CLI with the backend's output perturbed by noise of 5% of its
scale: plausible-looking but wrong hidden states, as a dishonest or broken volunteer would return. Started
with ``--public-name faulty-reuse`` it lies only on passes that reuse the activation cache (a liar that hopes
the checks skip those). Started with ``--head`` it answers head queries with every other predicted token
replaced by the next id (well-formed predictions, wrong tokens).
"""
import sys

import torch

from swarm.server import backend

_honest_forward = backend.SpanBackend.forward_sync
REUSE_ONLY = "faulty-reuse" in sys.argv


def _perturbed_forward(self, hidden, start, end, kv=None, rows=None, head=None, *rest, **options):
    output = _honest_forward(self, hidden, start, end, kv, rows, head, *rest, **options)
    if REUSE_ONLY and rows is None:
        return output
    if head is not None:  # predictions: lie about tokens, keep everything in range
        output = output.clone()
        tokens = output[..., ::2, 0]
        wrong = (tokens + 1) % self.head.config.vocab_size
        output[..., ::2, 0] = torch.where(wrong == head.mask_token_id, (wrong + 1) % self.head.config.vocab_size,
                                          wrong)
        return output
    return output + 0.05 * output.std() * torch.randn_like(output)


backend.SpanBackend.forward_sync = _perturbed_forward

if __name__ == "__main__":
    from swarm.server.__main__ import main

    main()
