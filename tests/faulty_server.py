"""A deliberately faulty server for the spot-check tests (never a production flag).

Runs the real ``python -m swarm.server`` CLI with the backend's output perturbed by noise of 5% of its
scale: plausible-looking but wrong hidden states, as a dishonest or broken volunteer would return. The mode is
chosen by ``--public-name``:

* (any other name) lies on every answer. Started with ``--head`` it answers head queries with every other
  predicted token replaced by the next id (well-formed predictions, wrong tokens). Announced slower than an honest
  replica, so that routes never pick it, every call it answers is a spot check: a liar acting only as checker.
* ``faulty-reuse`` lies only on passes that reuse the activation cache (a liar that hopes the checks skip those).
* ``faulty-head`` (with ``--head``) lies only in its predictions; the hidden states it answers when asked for them
  are honest (a liar that hopes no replica without the head can check it).
* ``faulty-1in20`` (any N in ``faulty-1inN``) lies on a random one in N of its answers.
* ``faulty-later`` lies only on a session's later calls: the first call of each shape (batch, length) is honest, and
  so is every call of a fresh session an auditor used to send (issue 48).
* ``faulty-cache`` lies only on calls that fill or reuse the activation cache.
* ``faulty-adapter`` lies only on calls that carry a per-block adapter.
* ``faulty-stall`` answers its first call (the client's compute challenge) honestly and holds every later one.
* ``faulty-spare-PEERID`` lies on every answer except to the peer PEERID (an auditor's known identity: the attack
  that an auditor's fresh identity per round defeats, tests/test_audit_swarm.py).
* ``faulty-seenS`` (any S) lies only to callers whose peer id it first served S seconds ago or more: a
  long-lived client gets lies, an audit round's fresh identity never does (issue 55).
* ``faulty-merged`` lies only on the rows of passes it merged across clients (``--batching``); each pass holds the
  compute thread 50 ms longer, so concurrent clients' calls queue and merge (issue 55).
* ``faulty-rateR`` (any R) answers honestly but never faster than R positions per second through its span (it holds
  the compute thread for the rest): started with ``--throughput`` 10 R it announces 10 times what it delivers
  (benchmarks/audit_demo.py).
"""
import random
import re
import sys
import time

import torch

from swarm.server import backend

_honest_forward = backend.SpanBackend.forward_sync
_honest_async_forward = backend.SpanBackend.forward
NAME = next((arg for arg in sys.argv if arg.startswith("faulty")), "faulty")
ONE_IN = re.fullmatch(r"faulty-1in(\d+)", NAME)
SPARED = NAME[len("faulty-spare-"):] if NAME.startswith("faulty-spare-") else None
RATE = re.fullmatch(r"faulty-rate(\d+)", NAME)
SEEN = re.fullmatch(r"faulty-seen(\d+)", NAME)
_honest_batch = backend.SpanBackend.forward_batch_sync
_calls = [0]
_shapes_seen: set[tuple[int, ...]] = set()  # the shapes of calls answered so far (faulty-later)
_spared_calls: set[int] = set()  # ids of calls from the spared peer (the compute thread reads it)
_first_seen: dict[str, float] = {}  # caller -> when first served (faulty-seenS)
_callers: dict[int, str] = {}  # id(call) -> its caller, while it runs


def _lies_now(rows, head, call=None) -> bool:
    """Whether this answer is a lie, in the mode ``NAME`` chooses."""
    if SPARED is not None:
        return id(call) not in _spared_calls
    if SEEN:
        caller = _callers.get(id(call), "")
        return time.monotonic() - _first_seen.get(caller, time.monotonic()) >= int(SEEN.group(1))
    if NAME == "faulty-merged":
        return False  # alone: honest; merged rows lie in _perturbed_batch
    if NAME == "faulty-reuse":
        return rows is not None
    if NAME == "faulty-head":
        return head is not None
    if NAME == "faulty-later":
        shape = tuple(call.hidden.shape[:2])
        seen = shape in _shapes_seen
        _shapes_seen.add(shape)
        return seen
    if NAME == "faulty-cache":
        return call.kv is not None
    if NAME == "faulty-adapter":
        return call.adapter is not None
    if ONE_IN:
        return random.randrange(int(ONE_IN.group(1))) == 0
    return True


def _wrong_predictions(self, output, head):
    """Every other predicted token replaced by the next id, everything kept in range."""
    output = output.clone()
    vocab = self.head.config.vocab_size
    wrong = (output[..., ::2, 0] + 1) % vocab
    output[..., ::2, 0] = torch.where(wrong == head.mask_token_id, (wrong + 1) % vocab, wrong)
    return output


def _perturbed_forward(self, call, *rest, **options):
    _calls[0] += 1
    if NAME == "faulty-stall" and _calls[0] > 1:
        time.sleep(3600)
    started = time.perf_counter()
    if NAME == "faulty-merged":  # as slow alone as merged: concurrent calls queue behind it
        time.sleep(0.05)
    output = _honest_forward(self, call, *rest, **options)
    if RATE:  # honest, at R positions per second at most
        positions = call.hidden.shape[0] * call.hidden.shape[1]
        time.sleep(max(0.0, positions / int(RATE.group(1)) - (time.perf_counter() - started)))
        return output
    if NAME == "faulty-stall" or not _lies_now(call.rows, call.head, call):
        return output
    if call.head is not None:  # predictions: lie about tokens, keep everything in range
        return _wrong_predictions(self, output, call.head)
    return output + 0.05 * output.std() * torch.randn_like(output)


def _perturbed_batch(self, items):
    """Merged passes (faulty-merged): every row of a pass that merged several clients' calls is a lie."""
    if NAME == "faulty-merged":
        time.sleep(0.05)
    answers = _honest_batch(self, items)
    if NAME != "faulty-merged" or len(items) < 2:
        return answers
    return [answer + 0.05 * answer.std() * torch.randn_like(answer) if answer.dtype != torch.float64
            else _wrong_predictions(self, answer, call.head) for answer, (call, _) in zip(answers, items)]


async def _forward_noting_the_caller(self, call, *, peer="", grant=None):
    """The honest entry point, noting the caller (the grant names it): whether it is the spared peer, and since
    when it is served."""
    caller = grant.peer if grant is not None else peer
    if caller == SPARED:
        _spared_calls.add(id(call))
    _first_seen.setdefault(caller, time.monotonic())
    _callers[id(call)] = caller
    try:
        return await _honest_async_forward(self, call, peer=peer, grant=grant)
    finally:
        _spared_calls.discard(id(call))
        _callers.pop(id(call), None)


backend.SpanBackend.forward_sync = _perturbed_forward
backend.SpanBackend.forward_batch_sync = _perturbed_batch
backend.SpanBackend.forward = _forward_noting_the_caller

if __name__ == "__main__":
    from swarm.server.__main__ import main

    main()
