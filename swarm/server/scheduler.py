"""Which waiting pass the compute thread runs next: work-conserving, fair by caller where callers prove work.

The compute thread never idles while a pass waits (:meth:`FairScheduler.pop` answers whenever anything is queued), so
no caller is ever refused or delayed for its share while the server has idle compute. Under contention the waiting
passes are served in weighted fair order (start-time fair queuing, the continuous form of deficit round robin): each
*flow* has a virtual tag, a pass of ``cost`` advances its flow's tag by ``cost / weight``, and the flow with the
smallest tag goes next. A flow that comes back after idling starts at the current virtual time, so idling banks no
credit.

Identities are free (a new libp2p id per call costs nothing), so an id is never a flow of its own for being an id,
nor for having been around: ids made in advance cost nothing either (issue 55 class 6: 16 ids that each made 8 calls
took 94% of a busy server). A caller gets a flow of its own only with *proved work*: a request may carry a work stamp
(:mod:`swarm.wire.work`), which the server checks and credits to the caller's *standing* in units of cost (decaying
by half every ``half_life`` seconds); a pass whose cost the standing covers is charged to it and joins the caller's
own flow. Every other pass, whoever sends it, shares one flow, the newcomers' (round robin by id inside it), so a
thousand fresh or patient ids weigh what one paying caller does, and k flows cost an attacker k callers' stamps for
every pass, all the time (docs/GOVERNANCE.md).

``--max-share-per-caller`` keeps its meaning as an order, never a refusal: a flow whose caller used more than that
share of the compute in the window goes after every flow within its share, and is still served at once when nobody
else waits.

A long pass may run in pieces (:meth:`FairScheduler.resume`): charged in full when it starts, its later pieces wait
behind the flows that have had less, so a small call waits for one piece of it, not for all of it.

Bounded: the flows with a pass queued (at most the compute queue's places), the finish tags of at most
``max_identities`` flows that emptied lately, and the standing of at most ``max_identities`` callers (only callers
that proved work have one, least recently credited forgotten first). Pure: no threads, no sockets; the clock is passed
in.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

NEWCOMERS = ("newcomers",)  # the key of the flow every pass without proved work shares (not a str: no peer id)
MAX_IDENTITIES = 4096  # callers' standing kept, and finish tags of flows that emptied lately
HALF_LIFE_S = 60.0  # standing halves in this time: proved work credited is spent soon or lost


@dataclass
class Job:
    """One pass waiting for the compute thread: whose it is, what it is counted at, and what it carries (``key``:
    passes with equal keys may be computed together; None runs alone)."""

    peer: str
    cost: float
    payload: Any = None
    key: Optional[Hashable] = None
    dropped: Callable[[], bool] = lambda: False  # its caller stopped waiting: skipped, never run
    size: int = 0  # positions (batch x length), for the bound on a merged pass
    proved: float = 0.0  # units of cost the request's work stamp proved (checked by the server), credited at push
    resumed: bool = False  # a pass already under way (charged in full when it started): its next piece costs nothing
    flow: Optional[Hashable] = None  # the flow it joined (its caller's own, or the newcomers'), set at push


@dataclass
class Flow:
    tag: float = 0.0
    jobs: deque = field(default_factory=deque)  # a paying caller's passes, in arrival order
    members: OrderedDict = field(default_factory=OrderedDict)  # the newcomers' flow: peer -> deque of its passes

    def __len__(self) -> int:
        return len(self.jobs) + sum(len(queue) for queue in self.members.values())


@dataclass
class Standing:
    """Proved work not yet spent, in units of cost, as of ``when``."""

    balance: float
    when: float

    def at(self, now: float, half_life: float) -> float:
        return self.balance * 0.5 ** (max(0.0, now - self.when) / half_life)


class FairScheduler:
    """Queued passes by flow, popped in weighted fair order (see the module doc). ``over_share(peer)`` says whether a
    caller is over ``--max-share-per-caller`` now (None: no cap)."""

    def __init__(self, half_life: float = HALF_LIFE_S, max_identities: int = MAX_IDENTITIES,
                 over_share: Optional[Callable[[str], bool]] = None):
        if half_life <= 0 or max_identities < 1:
            raise ValueError("half_life must be positive and max_identities at least 1")
        self.half_life, self.max_identities, self.over_share = half_life, max_identities, over_share
        self.flows: dict[Hashable, Flow] = {}
        self.vtime = 0.0
        self.order = itertools.count()  # ties between equal tags go to the flow that became active first
        self.arrival: dict[Hashable, int] = {}
        # the finish tags of flows that emptied lately: a caller that sends its next pass as soon as its last is
        # answered restarts where it finished, not at the current virtual time (else it would be served again free)
        self.finished: OrderedDict[Hashable, float] = OrderedDict()
        self.standing: OrderedDict[str, Standing] = OrderedDict()
        self.forgotten = 0

    def __len__(self) -> int:
        return sum(len(flow) for flow in self.flows.values())

    # ----- standing --------------------------------------------------------------------------------
    def standing_of(self, peer: str, now: float) -> float:
        """``peer``'s proved work not yet spent, in units of cost."""
        record = self.standing.get(peer)
        return record.at(now, self.half_life) if record is not None else 0.0

    def flow_for(self, job: Job, now: float) -> Hashable:
        """Credit ``job``'s proved work to its caller; the flow it joins: its caller's own when the standing covers its
        cost (then spent), else the newcomers'."""
        balance = self.standing_of(job.peer, now) + max(0.0, job.proved)
        if balance <= 0:
            return NEWCOMERS
        own = balance >= job.cost
        self.standing.pop(job.peer, None)
        self.standing[job.peer] = Standing(balance - job.cost if own else balance, now)  # most recently credited last
        while len(self.standing) > self.max_identities:
            self.standing.popitem(last=False)
            self.forgotten += 1
        return job.peer if own else NEWCOMERS

    # ----- queue -----------------------------------------------------------------------------------
    def push(self, job: Job, now: float = 0.0) -> None:
        """Queue ``job`` (``now``: the clock, in seconds, for the standing's decay)."""
        job.flow = self.flow_for(job, now)
        self._enqueue(job.flow, job)

    def resume(self, job: Job) -> None:
        """A pass that ran one piece and has more (a long pass runs in pieces between blocks, so a small one need not
        wait for all of it): back at the head of its queue in the flow it joined. It was charged in full when it
        started, so its flow's tag already stands behind the passes of callers that have had less; they go first."""
        job.resumed = True
        self._enqueue(job.flow, job, first=True)

    def _enqueue(self, key: Hashable, job: Job, first: bool = False) -> None:
        flow = self.flows.get(key)
        if flow is None:  # (re)activated: no credit for the time it was idle, no discount on what it just had
            flow = self.flows[key] = Flow(tag=max(self.vtime, self.finished.pop(key, self.vtime)))
            self.arrival[key] = next(self.order)
        queue = flow.members.setdefault(job.peer, deque()) if key == NEWCOMERS else flow.jobs
        if first:
            queue.appendleft(job)
        else:
            queue.append(job)

    def pop(self, match: Optional[Callable[[Job], bool]] = None) -> Optional[Job]:
        """The next pass to run (None when nothing waits, or nothing that ``match`` accepts), its flow charged."""
        self._skip_dropped()
        candidates = [(key, flow) for key, flow in self.flows.items() if self._first(flow, match) is not None]
        if not candidates:
            return None
        contended = len(candidates) > 1  # a share orders callers only against others waiting
        key, flow = min(candidates, key=lambda item: (contended and self._demoted(item[0]), item[1].tag,
                                                      self.arrival[item[0]]))
        job = self._take(flow, match)
        if not job.resumed:  # a later piece was charged at its pass's start: the virtual time stays, or a caller
            self.vtime = max(self.vtime, flow.tag)  # coming now would start behind every long pass under way
            flow.tag += job.cost  # each flow weighs 1; the newcomers' flow one, whatever its size
        if not len(flow):
            self._drop_flow(key)
        return job

    def _demoted(self, key: Hashable) -> bool:
        if self.over_share is None or key == NEWCOMERS:
            return False
        return self.over_share(key)

    @staticmethod
    def _queues(flow: Flow) -> list[deque]:
        return [flow.jobs] if not flow.members else list(flow.members.values())

    def _first(self, flow: Flow, match: Optional[Callable[[Job], bool]]) -> Optional[Job]:
        for queue in self._queues(flow):
            for job in queue:
                if match is None or match(job):
                    return job
        return None

    def _take(self, flow: Flow, match: Optional[Callable[[Job], bool]]) -> Job:
        """The first matching pass; among newcomers, of the first member that has one, which then goes last."""
        if not flow.members:
            job = self._first(flow, match)
            flow.jobs.remove(job)
            return job
        for peer, queue in flow.members.items():
            job = next((job for job in queue if match is None or match(job)), None)
            if job is not None:
                queue.remove(job)
                del flow.members[peer]
                if queue:
                    flow.members[peer] = queue  # round robin: its next pass waits for the other members' turn
                return job
        raise LookupError("no matching pass")  # callers check _first before

    def _skip_dropped(self) -> None:
        for key, flow in list(self.flows.items()):
            for queue in self._queues(flow):
                for job in [job for job in queue if job.dropped()]:
                    queue.remove(job)
            for peer in [peer for peer, queue in flow.members.items() if not queue]:
                del flow.members[peer]
            if not len(flow):
                self._drop_flow(key)

    def _drop_flow(self, key: Hashable) -> None:
        flow = self.flows.pop(key, None)
        self.arrival.pop(key, None)
        if flow is not None and flow.tag > self.vtime:
            self.finished.pop(key, None)
            self.finished[key] = flow.tag
            while len(self.finished) > self.max_identities or (self.finished and
                                                               next(iter(self.finished.values())) <= self.vtime):
                self.finished.popitem(last=False)  # the oldest first; one at or below the virtual time means nothing

    def info(self) -> dict:
        return {"queued": len(self), "flows": len(self.flows), "standing": len(self.standing),
                "forgotten": self.forgotten}
