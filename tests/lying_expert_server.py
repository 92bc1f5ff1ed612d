"""An expert server whose sparse answers are malformed (for the client's checks; never a production flag).

Runs the real ``python -m swarm.server`` CLI with the expert handler's answer corrupted after it is made, a
different way on each call: a duplicate id, an id outside the vocabulary, unsorted ids, a log-probability above 0,
NaN, a rest that does not fit. Each is well-typed and of the right shape, so only the client's check
(``SparseScores.check``) can tell.
"""
import itertools
import sys

import torch

from swarm.diffusion.sparse import SparseScores
from swarm.server import expert_handler

_honest = expert_handler.expert_scores


def _replace(answer: SparseScores, **changes) -> SparseScores:
    fields = dict(ids=answer.ids.clone(), log_probs=answer.log_probs.clone(), rest=answer.rest.clone())
    fields.update(changes)
    return SparseScores(vocab_size=answer.vocab_size, **fields)


def _duplicate(answer):
    ids = answer.ids.clone()
    ids[..., 1] = ids[..., 0]
    return _replace(answer, ids=ids)


def _outside(answer):
    ids = answer.ids.clone()
    ids[..., -1] = answer.vocab_size
    return _replace(answer, ids=ids)


def _unsorted(answer):
    return _replace(answer, ids=answer.ids.flip(-1))


def _positive(answer):
    scores = answer.log_probs.clone()
    scores[..., 0] = 0.5
    return _replace(answer, log_probs=scores)


def _nan(answer):
    scores = answer.log_probs.clone()
    scores[..., 0] = float("nan")
    return _replace(answer, log_probs=scores)


def _misfit(answer):
    return _replace(answer, rest=torch.zeros_like(answer.rest))  # the rest alone already holds all the mass


LIES = itertools.cycle([_duplicate, _outside, _unsorted, _positive, _nan, _misfit])


def _lying_scores(log_probs, top_k):
    answer = _honest(log_probs, top_k)
    return next(LIES)(answer) if isinstance(answer, SparseScores) else answer


expert_handler.expert_scores = _lying_scores

if __name__ == "__main__":
    from swarm.server.__main__ import main

    sys.argv[0] = "swarm.server"
    main()
