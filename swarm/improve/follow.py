"""Trainers that follow a stream coordinator (issue 57, docs/TRAINING.md "Stream records").

A trainer started with ``--stream-coordinator KEY`` offers its own stream (``--name``, ``--task``, ``--data``) and
the others it can train (``--also-stream NAME:TASK:DATA``). Before every round it reads that coordinator's signed
record (``swarm.improve.stream_records``: only that key's) and trains the stream the record assigns its node (its
peer id) when it offers it; otherwise (no record, its node in no pool, a stream it does not offer) it keeps the one
it trains. With ``--round-per-record`` it starts a round only on a record newer than the one its last round
followed, so the coordinator paces the rounds (one a record). Each stream has its own improver, workdir
(``WORKDIR/streams/NAME``; the trainer's own stream keeps ``WORKDIR``) and, when the trainer collaborates
(``--run-id``), the stream's name as run id, so that the nodes of one pool train together; the versions of every
stream are served by the trainer's one host, which is how the coordinator sees what each node works for.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from swarm.improve.config import ImproveConfig, StreamOffer, offers_of

if TYPE_CHECKING:
    from swarm.improve.loop import Improver, RoundResult
    from swarm.improve.stream_records import StreamRecord

logger = logging.getLogger(__name__)


def stream_workdir(workdir: str | Path, own: str, name: str) -> Path:
    """Where a follower whose own stream is ``own`` keeps stream ``name``'s run: ``workdir`` for its own stream,
    ``workdir/streams/NAME`` for another."""
    return Path(workdir) if name == own else Path(workdir) / "streams" / name


def stream_config(base: ImproveConfig, offer: StreamOffer) -> ImproveConfig:
    """The trainer's settings for one stream (see the module doc)."""
    if offer.name == base.name:
        return base
    return dataclasses.replace(base, name=offer.name, task=offer.task, data=offer.data,
                               workdir=str(stream_workdir(base.workdir, base.name, offer.name)),
                               run_id=offer.name if base.run_id else None, stream_coordinator=None, also_streams=(),
                               round_per_record=False)


def stream_for(record: Optional[StreamRecord], peer_id: str, offered: Sequence[str], current: str) -> str:
    """The stream this node trains next: the record's assignment of it when it offers that stream, else ``current``."""
    assigned = record.assignment().get(peer_id) if record is not None else None
    return assigned if assigned in offered else current


class Follower:
    """Round after round, the improver of the stream the coordinator assigns this node (see the module doc)."""

    def __init__(self, config: ImproveConfig, make: Callable[[ImproveConfig], Improver],
                 read: Callable[[], Optional[StreamRecord]], peer_id: str):
        self.config, self.make, self.read, self.peer_id = config, make, read, peer_id
        self.offers = {offer.name: offer for offer in offers_of(config)}
        self.improvers: dict[str, Improver] = {}
        self.current = config.name
        self.followed = -1  # the sequence of the record the last round followed (``round_per_record``)

    def improver(self, name: str) -> Improver:
        if name not in self.improvers:
            self.improvers[name] = self.make(stream_config(self.config, self.offers[name]))
        return self.improvers[name]

    def step(self) -> Optional[RoundResult]:
        """Read the record, move if it says so, run one round of the stream (None: nothing to train on yet)."""
        try:
            record = self.read()
        except Exception as error:  # an unreadable DHT keeps the stream trained now
            logger.warning("could not read the stream coordinator's record: %r", error)
            record = None
        if self.config.round_per_record and (record is None or record.sequence <= self.followed):
            return None  # the coordinator paces the rounds: its next record starts the next one
        chosen = stream_for(record, self.peer_id, list(self.offers), self.current)
        if chosen != self.current:
            logger.info("moving from stream %s to %s: the coordinator's record %d assigns this node there",
                        self.current, chosen, record.sequence)
            self.current = chosen
        result = self.improver(chosen).run_round()
        if result is not None and record is not None:
            self.followed = record.sequence
        return result

    def run(self) -> list[tuple[str, RoundResult]]:
        """``rounds`` rounds in all (0: until interrupted): (stream, result) of each."""
        results = []
        while not self.config.rounds or len(results) < self.config.rounds:
            result = self.step()
            if result is None:
                time.sleep(self.config.poll)
                continue
            results.append((self.current, result))
        return results

    def close(self) -> None:
        for improver in self.improvers.values():
            improver.close(close_host=False)  # one host serves every stream's versions: its owner closes it
